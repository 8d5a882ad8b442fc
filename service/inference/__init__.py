"""The inference half: batched embeddings and linear-probe classification over hub models."""
