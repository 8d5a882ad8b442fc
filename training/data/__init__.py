"""Data: private image folders and tar shards, labelled arrays (Fashion-MNIST's IDX
files), procedural images."""
