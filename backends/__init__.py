"""parlay backends: lowering the layout IR to PyTorch and to JAX."""
