"""The neutral ops' local math on torch tensors (``LocalOps``): whole tensors for one process
(``DenseOps(TorchLocal())``), one rank's blocks in the sharded executor.

The norms, attention and the loss run parlay's Triton kernels where the switch says so (by
default: on CUDA tensors when Triton works), plain torch otherwise; see parlay.triton_kernels.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from ... import triton_kernels
from ...core.ops import vocab_cross_entropy
from ...triton_kernels import Kernels, should_use_triton
from .remat import saved

__all__ = ["TorchLocal"]


class TorchLocal:
    def __init__(self, *, kernels: Kernels | str | None = None, device: torch.device | str = "cpu"):
        """``kernels``: "auto", "triton" or "torch" for the norms, attention and the loss; None
        defers to ``parlay.triton_kernels.use_kernels`` / ``$PARLAY_KERNELS`` at each call."""
        self.kernels = None if kernels is None else Kernels.parse(kernels)
        self.device = torch.device(device)

    def uses_triton(self, *tensors: torch.Tensor, supported: bool = True) -> bool:
        return should_use_triton(self.kernels, *tensors, supported=supported)

    def constant(self, value):
        return torch.from_numpy(np.ascontiguousarray(value)).to(self.device)

    def einsum(self, equation, *xs):
        return torch.einsum(equation, *xs)

    def gelu(self, x):
        return F.gelu(x, approximate="tanh")

    def silu(self, x):
        return F.silu(x)

    def relu(self, x):
        return torch.relu(x)

    def tanh(self, x):
        return torch.tanh(x)

    def softmax(self, x, dim):
        return torch.softmax(x, dim, dtype=torch.float32).to(x.dtype)  # in float32 (core/precision.py)

    def sum(self, x, dim, *, keepdim=False):
        return x.sum(dim, keepdim=keepdim)

    def max(self, x, dim, *, keepdim=False):
        return x.detach().amax(dim, keepdim=keepdim)

    def exp(self, x):
        return torch.exp(x)

    def log(self, x):
        return torch.log(x)

    def rsqrt(self, x):
        return torch.rsqrt(x)

    # The norms compute in float32 and hand back x's dtype (core/precision.py). The Triton kernels
    # do the same in any compute dtype: rows and weights read as float32, statistics float32, y
    # and dx written in x's dtype (the weight's cast to it, as autocast's rule, is the caller's).
    def rms_norm(self, x, scale, eps):
        if self.uses_triton(x, scale, supported=x.shape[-1] * x.element_size() <= 65536 and _same(x, scale)):
            return triton_kernels.rms_norm(x, scale, eps)
        w = x.float()
        return (w * torch.rsqrt(torch.mean(w * w, dim=-1, keepdim=True) + eps) * scale).to(x.dtype)

    def layer_norm(self, x, scale, bias, eps):
        if self.uses_triton(x, scale, bias, supported=x.shape[-1] * x.element_size() <= 65536
                            and _same(x, scale, bias)):
            return triton_kernels.layer_norm(x, scale, bias, eps)
        w = x.float()
        mean = w.mean(-1, keepdim=True)
        var = ((w - mean) ** 2).mean(-1, keepdim=True)
        return ((w - mean) * torch.rsqrt(var + eps) * scale + bias).to(x.dtype)

    def take(self, table, ids):
        return table[ids.long()]

    def take_last(self, x, ids):
        return torch.gather(x, -1, ids.long()[..., None])[..., 0]

    def where(self, mask, x, y):
        return torch.where(mask, x, y)

    def concat(self, xs, dim):
        return torch.cat(list(xs), dim)

    def barrier(self, xs):
        return xs  # eager: each step runs when written

    def cast(self, x, like):
        return torch.as_tensor(x, device=like.device).to(like.dtype)

    def astype(self, x, dtype):
        return x.to(getattr(torch, dtype)) if x.is_floating_point() else x

    def iota(self, shape, dim):
        view = [1] * len(shape)
        view[dim] = shape[dim]
        return torch.arange(shape[dim], dtype=torch.int32, device=self.device).reshape(view)

    def rotary(self, x, cos, sin):
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        c, s = cos[None, :, None, :], sin[None, :, None, :]
        return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)

    def attention(self, q, k, v, *, causal=True):
        if self.uses_triton(q, k, v, supported=q.shape[-1] <= 256 and _same(q, k, v)):
            # The kernel takes (B, H, S, D): transposed views, no copies. Its softmax is float32 and
            # P @ V runs in v's dtype, as the torch path below (core/precision.py).
            with saved("attention"):
                out = triton_kernels.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal)
                return out.transpose(1, 2)  # (B, S, H, D)
        B, S, H, D = q.shape
        group = H // k.shape[2]
        k = k.repeat_interleave(group, dim=2)  # kv head j serves query heads j*group..
        v = v.repeat_interleave(group, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k).float() / math.sqrt(D)
        if causal:
            mask = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = scores.softmax(-1).to(v.dtype)  # in float32 (core/precision.py)
        with saved("attention"):  # what --remat selective keeps (core/remat.py)
            return torch.einsum("bhqk,bkhd->bqhd", probs, v)

    def rearrange(self, x, pattern, sizes):
        import einops

        return einops.rearrange(x, pattern, **sizes)

    def vocab_cross_entropy(self, logits, ids, hit, combine):
        if self.uses_triton(logits, supported=_f32(logits)):
            # ids are already local to the shard: the kernel's first column is 0, and a miss (-1)
            # is outside it. ``combine`` runs in the kernel's forward, on (positions,) statistics.
            return triton_kernels.vocab_parallel_cross_entropy(logits, torch.where(hit, ids, -1), vocab_start=0,
                                                               combine=combine)
        return vocab_cross_entropy(self, logits, ids, hit, combine)

    def cross_entropy(self, logits, targets):
        if self.uses_triton(logits, supported=_f32(logits)) and logits.ndim == 3:
            return triton_kernels.cross_entropy(logits, targets)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1).long())


def _f32(*xs: torch.Tensor) -> bool:
    return all(x.dtype == torch.float32 for x in xs)


def _same(*xs: torch.Tensor) -> bool:
    """One floating dtype for every operand (the kernels take float32, bfloat16 and float16)."""
    return len({x.dtype for x in xs}) == 1
