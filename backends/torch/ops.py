"""The neutral ops on plain torch tensors: the single-process reference."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from ...core.ops import LogicalDims

__all__ = ["TorchOps"]


class TorchOps:
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
        return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + eps) * scale

    def layer_norm(self, x, scale, bias, eps: float):
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
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
