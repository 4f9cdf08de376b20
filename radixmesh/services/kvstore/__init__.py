"""The kvstore service: the shared L3 tier of the hierarchical KV cache (a gRPC shell over one storage backend) and
the global prefix index fed by the workers' KV events."""
