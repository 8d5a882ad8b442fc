"""The models: encoder families and their registry, feature poolings, the DP-Cap text decoder, its
tokenizer."""
