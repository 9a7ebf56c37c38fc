"""Shared by the kernel tests: errors measured against a float64 reference."""

import torch


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute difference over the reference's largest magnitude."""
    got, ref = got.detach().double(), ref.detach().double()
    return float((got - ref).abs().max() / ref.abs().max())


def leaves(*tensors: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
    """The same values as ``dtype`` leaves, and as float64 leaves for the reference: both from the
    ``dtype``-rounded values, so the reference sees exactly the kernel's inputs."""
    low = [t.to(dtype).detach().requires_grad_() for t in tensors]
    return low + [t.detach().double().requires_grad_() for t in low]
