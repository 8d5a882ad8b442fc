"""The Hugging Face-compatible hub protocol: downloads, metadata, uploads."""
