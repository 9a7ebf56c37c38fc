"""The neutral ops' local math on jax arrays (``LocalOps``): whole arrays for the single device
and GSPMD mode (``DenseOps(JaxLocal(), ...)``), one device's blocks inside ``shard_map``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
import numpy as np

from ...core.ops import vocab_cross_entropy

__all__ = ["JaxLocal", "KERNEL"]

KERNEL = "kernel."


def _kernel(fn):
    """An op that parlay's torch backend runs as one kernel on a GPU (a Triton norm or flash
    attention, a torch activation): its equations are traced in the scope ``kernel.<op>``, so the
    cost model can count only what leaves it (backends/jax/memory.py ``_work``). Names only."""
    @functools.wraps(fn)
    def scoped(*args, **kwargs):
        with jax.named_scope(KERNEL + fn.__name__):
            return fn(*args, **kwargs)
    return scoped


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _softmax(x, axis: int):
    """Softmax whose backward keeps only its output (jax.nn.softmax's keeps its exponentials too):
    the gradient is y * (g - sum(g * y))."""
    return jax.nn.softmax(x, axis=axis)


def _softmax_fwd(x, axis):
    y = jax.nn.softmax(x, axis=axis)
    return y, y


def _softmax_bwd(axis, y, g):
    return (y * (g - jnp.sum(g * y, axis=axis, keepdims=True)),)


_softmax.defvjp(_softmax_fwd, _softmax_bwd)


class JaxLocal:
    def constant(self, value):
        return jnp.asarray(np.asarray(value))

    def einsum(self, equation, *xs):
        return jnp.einsum(equation, *xs, precision=jax.lax.Precision.HIGHEST)

    @_kernel
    def gelu(self, x):
        return jax.nn.gelu(x, approximate=True)

    @_kernel
    def silu(self, x):
        return jax.nn.silu(x)

    @_kernel
    def relu(self, x):
        return jax.nn.relu(x)

    @_kernel
    def tanh(self, x):
        return jnp.tanh(x)

    @_kernel
    def softmax(self, x, dim):
        return _softmax(x.astype(jnp.float32), dim % x.ndim).astype(x.dtype)  # in float32 (core/precision.py)

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

    # The norms compute in float32 and hand back x's dtype (core/precision.py).
    @_kernel
    def rms_norm(self, x, scale, eps):
        w = x.astype(jnp.float32)
        return (w * jax.lax.rsqrt(jnp.mean(w * w, axis=-1, keepdims=True) + eps) * scale).astype(x.dtype)

    @_kernel
    def layer_norm(self, x, scale, bias, eps):
        w = x.astype(jnp.float32)
        mean = jnp.mean(w, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(w - mean), axis=-1, keepdims=True)
        return ((w - mean) * jax.lax.rsqrt(var + eps) * scale + bias).astype(x.dtype)

    def take(self, table, ids):
        return jnp.take(table, ids, axis=0)

    def take_last(self, x, ids):
        return jnp.take_along_axis(x, ids[..., None], axis=-1)[..., 0]

    def where(self, mask, x, y):
        return jnp.where(mask, x, y)

    def concat(self, xs, dim):
        return jnp.concatenate(list(xs), axis=dim)

    def barrier(self, xs):
        return jax.lax.optimization_barrier(xs)

    def cast(self, x, like):
        return jnp.asarray(x).astype(like.dtype)

    def astype(self, x, dtype):
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

    def iota(self, shape, dim):
        return jax.lax.broadcasted_iota(jnp.int32, tuple(1 if d != dim else n for d, n in enumerate(shape)), dim)

    def rotary(self, x, cos, sin):
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]  # (B, S, H, D/2) each
        c, s = cos[None, :, None, :], sin[None, :, None, :]
        return jnp.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1)

    @_kernel
    def attention(self, q, k, v, *, causal=True):
        B, S, H, D = q.shape
        group = H // k.shape[2]
        k = jnp.repeat(k, group, axis=2)  # (B, S, H, D): kv head j serves query heads j*group..
        v = jnp.repeat(v, group, axis=2)
        scores = self.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / np.sqrt(D).astype(np.float32)
        if causal:  # an additive mask: its backward keeps nothing (a select would keep its predicate)
            scores = scores + np.where(np.tril(np.ones((S, S), dtype=bool)), 0.0, -np.inf).astype(np.float32)
        probs = _softmax(scores, scores.ndim - 1).astype(v.dtype)  # in float32 (core/precision.py)
        out = self.einsum("bhqk,bkhd->bqhd", probs, v)
        return checkpoint_name(out, "attention")  # what --remat selective keeps (core/remat.py)

    def rearrange(self, x, pattern, sizes):
        import einops

        return einops.rearrange(x, pattern, **sizes)

    def vocab_cross_entropy(self, logits, ids, hit, combine):
        return vocab_cross_entropy(self, logits, ids, hit, combine)

    def cross_entropy(self, logits, targets):
        logits = logits.astype(jnp.float32)
        logz = jax.nn.logsumexp(logits, axis=-1)
        return jnp.mean(logz - self.take_last(logits, targets))
