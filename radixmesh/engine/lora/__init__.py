"""Multi-LoRA serving: peft adapters checked and read (adapter.py), kept packed in host memory and placed in device
slots as batches need them (manager.py, pool.py, stacks.py), applied per token by the kernels of kernels.lora or
their twin (batch.py), inside CUDA graphs too (graph.py)."""
