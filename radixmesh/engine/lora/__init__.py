"""Multi-LoRA serving: adapters in peft's format (adapter.py) in device slots, applied per run of tokens (manager.py)."""
