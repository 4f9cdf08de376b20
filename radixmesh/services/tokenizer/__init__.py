"""The tokenizer service: chat templates, tokenization and batch detokenization for one model, over gRPC
(radixmesh.v1.TokenizerService). Stateless, so it scales horizontally.
Run: `python -m radixmesh.services.tokenizer --model-path PATH`."""
