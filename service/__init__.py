"""The vip-hub service: one FastAPI app with the hub (store, HF-compatible protocol, web
pages) and inference (batched embeddings and probe classification) halves."""
