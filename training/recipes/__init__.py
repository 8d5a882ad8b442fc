"""The recipes: (Syn)-ViP, ViP, DP-Cap, Logit-DP, DP fine-tuning, linear probes, and
the MAE they share; each a model, a loss and a clipper on the DP core."""
