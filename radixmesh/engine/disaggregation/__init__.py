"""Prefill/decode disaggregation: moving KV pages between workers (transfer backends behind a registry)."""
