"""Normalization ops: one file per op (Triton kernel, launcher, torch.library op, functional),
with the pure-torch references in reference.py. Nothing here imports transformers."""
