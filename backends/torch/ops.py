"""The neutral ops on plain torch tensors: the single-process reference.

The norms, attention and the loss run parlay's Triton kernels where the switch says so (by
default: on CUDA tensors when Triton works), plain torch otherwise; see parlay.triton_kernels.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from ... import triton_kernels
from ...core.ops import LogicalDims
from ...triton_kernels import Kernels, should_use_triton

__all__ = ["TorchOps"]


class TorchOps:
    def __init__(self, *, kernels: Kernels | str | None = None):
        """``kernels``: "auto", "triton" or "torch" for the norms, attention and the loss; None
        defers to ``parlay.triton_kernels.use_kernels`` / ``$PARLAY_KERNELS`` at each call."""
        self.kernels = None if kernels is None else Kernels.parse(kernels)

    def uses_triton(self, *tensors: torch.Tensor, supported: bool = True) -> bool:
        return should_use_triton(self.kernels, *tensors, supported=supported)

    def param(self, name: str, value, dims: LogicalDims):
        return value

    def constrain(self, x, dims: LogicalDims):
        return x

    def constant(self, value):
        return torch.from_numpy(np.asarray(value))

    def einsum(self, equation: str, *operands):
        return torch.einsum(equation, *operands)

    def add(self, x, y):
        return x + y

    def mul(self, x, y):
        return x * y

    def add_bias(self, x, b):
        return x + b  # b's dims are x's trailing dims

    def gelu(self, x):
        return F.gelu(x, approximate="tanh")

    def silu(self, x):
        return F.silu(x)

    def rms_norm(self, x, scale, eps: float):
        if self.uses_triton(x, scale, supported=x.shape[-1] * x.element_size() <= 65536):
            return triton_kernels.rms_norm(x, scale, eps)
        return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + eps) * scale

    def layer_norm(self, x, scale, bias, eps: float):
        if self.uses_triton(x, scale, bias, supported=x.shape[-1] * x.element_size() <= 65536):
            return triton_kernels.layer_norm(x, scale, bias, eps)
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        return (x - mean) * torch.rsqrt(var + eps) * scale + bias

    def embed(self, table, tokens):
        return table[tokens]

    def rotary(self, x, cos, sin):
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        c, s = cos[None, :, None, :], sin[None, :, None, :]
        return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)

    def attention(self, q, k, v, *, causal: bool = True):
        if self.uses_triton(q, k, v, supported=q.shape[-1] <= 256):
            # The kernel takes (B, H, S, D): transposed views, no copies.
            out = triton_kernels.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal)
            return out.transpose(1, 2)  # (B, S, H, D)
        B, S, H, D = q.shape
        group = H // k.shape[2]
        k = k.repeat_interleave(group, dim=2)  # kv head j serves query heads j*group..
        v = v.repeat_interleave(group, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)
        if causal:
            mask = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)

    def cross_entropy(self, logits, targets):
        if self.uses_triton(logits):
            return triton_kernels.cross_entropy(logits, targets)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
