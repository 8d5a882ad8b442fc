"""Recipes that produce released encoders: procedural images, MAE pretraining, DP-AdamW, probes."""
