"""The neutral ops on jax arrays: the single-device reference, and GSPMD mode's global arrays.

``constrain`` and ``param`` are hooks: identity on one device; ``with_sharding_constraint`` to
the strategy's layouts in GSPMD mode.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ...core.ops import LogicalDims

__all__ = ["JaxOps"]

Hook = Callable[[jax.Array, LogicalDims], jax.Array]


class JaxOps:
    def __init__(self, *, constrain: Hook | None = None, param: Hook | None = None):
        self._constrain = constrain
        self._param = param

    def param(self, name: str, value, dims: LogicalDims):
        return value if self._param is None else self._param(value, dims)

    def constrain(self, x, dims: LogicalDims):
        return x if self._constrain is None else self._constrain(x, dims)

    def constant(self, value):
        return jnp.asarray(np.asarray(value))

    def einsum(self, equation: str, *operands):
        return jnp.einsum(equation, *operands, precision=jax.lax.Precision.HIGHEST)

    def add(self, x, y):
        return x + y

    def mul(self, x, y):
        return x * y

    def add_bias(self, x, b):
        return x + b  # b's dims are x's trailing dims

    def gelu(self, x):
        return jax.nn.gelu(x, approximate=True)

    def silu(self, x):
        return jax.nn.silu(x)

    def rms_norm(self, x, scale, eps: float):
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale

    def layer_norm(self, x, scale, bias, eps: float):
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + eps) * scale + bias

    def embed(self, table, tokens):
        return jnp.take(table, tokens, axis=0)  # (B, S, E)

    def rotary(self, x, cos, sin):
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]  # (B, S, H, D/2) each
        c, s = cos[None, :, None, :], sin[None, :, None, :]
        return jnp.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1)

    def attention(self, q, k, v, *, causal: bool = True):
        B, S, H, D = q.shape
        group = H // k.shape[2]
        k = jnp.repeat(k, group, axis=2)  # (B, S, H, D): kv head j serves query heads j*group..
        v = jnp.repeat(v, group, axis=2)
        scores = self.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D).astype(np.float32)
        if causal:
            mask = np.tril(np.ones((S, S), dtype=bool))
            scores = jnp.where(mask, scores, -jnp.inf)
        return self.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)

    def cross_entropy(self, logits, targets):
        logz = jax.nn.logsumexp(logits, axis=-1)  # (B, S)
        picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        return jnp.mean(logz - picked)
