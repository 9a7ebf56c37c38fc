"""Triton kernels for the PyTorch backend; see the README for what has landed."""
