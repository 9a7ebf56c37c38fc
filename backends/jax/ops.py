"""The neutral ops' local math on jax arrays (``LocalOps``): whole arrays for the single device
and GSPMD mode (``DenseOps(JaxLocal(), ...)``), one device's blocks inside ``shard_map``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
import numpy as np

from ...core.ops import vocab_cross_entropy

__all__ = ["JaxLocal"]


class JaxLocal:
    def constant(self, value):
        return jnp.asarray(np.asarray(value))

    def einsum(self, equation, *xs):
        return jnp.einsum(equation, *xs, precision=jax.lax.Precision.HIGHEST)

    def gelu(self, x):
        return jax.nn.gelu(x, approximate=True)

    def silu(self, x):
        return jax.nn.silu(x)

    def relu(self, x):
        return jax.nn.relu(x)

    def tanh(self, x):
        return jnp.tanh(x)

    def softmax(self, x, dim):
        return jax.nn.softmax(x, axis=dim)

    def sum(self, x, dim, *, keepdim=False):
        return jnp.sum(x, axis=dim, keepdims=keepdim)

    def max(self, x, dim, *, keepdim=False):
        return jax.lax.stop_gradient(jnp.max(x, axis=dim, keepdims=keepdim))

    def exp(self, x):
        return jnp.exp(x)

    def log(self, x):
        return jnp.log(x)

    def rsqrt(self, x):
        return jax.lax.rsqrt(x)

    def rms_norm(self, x, scale, eps):
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale

    def layer_norm(self, x, scale, bias, eps):
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + eps) * scale + bias

    def take(self, table, ids):
        return jnp.take(table, ids, axis=0)

    def take_last(self, x, ids):
        return jnp.take_along_axis(x, ids[..., None], axis=-1)[..., 0]

    def where(self, mask, x, y):
        return jnp.where(mask, x, y)

    def cast(self, x, like):
        return jnp.asarray(x).astype(like.dtype)

    def iota(self, shape, dim):
        return jax.lax.broadcasted_iota(jnp.int32, tuple(1 if d != dim else n for d, n in enumerate(shape)), dim)

    def rotary(self, x, cos, sin):
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]  # (B, S, H, D/2) each
        c, s = cos[None, :, None, :], sin[None, :, None, :]
        return jnp.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1)

    def attention(self, q, k, v, *, causal=True):
        B, S, H, D = q.shape
        group = H // k.shape[2]
        k = jnp.repeat(k, group, axis=2)  # (B, S, H, D): kv head j serves query heads j*group..
        v = jnp.repeat(v, group, axis=2)
        scores = self.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D).astype(np.float32)
        if causal:
            scores = jnp.where(np.tril(np.ones((S, S), dtype=bool)), scores, -jnp.inf)
        out = self.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        return checkpoint_name(out, "attention")  # what --remat selective keeps (core/remat.py)

    def rearrange(self, x, pattern, sizes):
        import einops

        return einops.rearrange(x, pattern, **sizes)

    def vocab_cross_entropy(self, logits, ids, hit, combine):
        return vocab_cross_entropy(self, logits, ids, hit, combine)

    def cross_entropy(self, logits, targets):
        logz = jax.nn.logsumexp(logits, axis=-1)
        return jnp.mean(logz - self.take_last(logits, targets))
