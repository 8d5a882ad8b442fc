"""The hub's web pages: the model list and one page per model."""
