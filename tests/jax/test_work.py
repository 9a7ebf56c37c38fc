"""The cost model's written bytes (backends/jax/memory.py ``_work``): an op that is one kernel on a
GPU (a ``kernel.*`` scope of ``JaxLocal``) writes exactly what leaves it, its outputs and its
input gradients, where the unfused count adds every intermediate (the s x s scores of attention,
the float32 copies of a norm). Checked against the bytes of the values themselves."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parlay.backends.jax.memory import _work
from parlay.backends.jax.ops import JaxLocal
from parlay.core.cost import PROFILES, Written

OPS = JaxLocal()


def _counts(fn, *args):
    """(flops, every op's bytes, kernels' bytes) of ``fn``'s value and its gradients for a cotangent."""
    def both(*xs):
        out, pull = jax.vjp(fn, *xs[:-1])
        return out, pull(xs[-1])
    out = jax.eval_shape(fn, *args)
    g = jnp.ones(out.shape, out.dtype)
    return _work(jax.make_jaxpr(both)(*args, g).jaxpr)


def _bytes(*xs) -> int:
    return sum(x.size * x.dtype.itemsize for x in xs)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_norm_kernel_writes_its_output_and_gradients_only(dtype):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 8, 64)), dtype)
    scale, bias = jnp.ones(64, dtype), jnp.zeros(64, dtype)
    _, ops, kernels = _counts(lambda x, s, b: OPS.layer_norm(x, s, b, 1e-5), x, scale, bias)
    assert kernels == _bytes(x, x, scale, bias)  # y; dx, dscale, dbias
    assert ops > 5 * kernels  # the unfused count: float32 copies, centred rows, their gradients


def test_an_attention_kernel_writes_no_scores():
    rng = np.random.default_rng(1)
    B, S, H, D = 2, 32, 4, 8
    q, k, v = (jnp.asarray(rng.standard_normal((B, S, H, D)), jnp.bfloat16) for _ in range(3))
    flops, ops, kernels = _counts(lambda q, k, v: OPS.attention(q, k, v, causal=True), q, k, v)
    assert kernels == _bytes(q, q, k, v)  # o; dq, dk, dv
    assert ops > B * H * S * S * 4  # at least one float32 score matrix
    assert flops == 2 * B * H * S * S * D * 6  # QK^T and PV, forward; four products backward


def test_ops_outside_a_kernel_count_every_write_and_kernels_feed_each_other_through_memory():
    x = jnp.ones((4, 16), jnp.float32)
    scale = jnp.ones(16, jnp.float32)
    fn = lambda x, s: OPS.gelu(OPS.rms_norm(x, s, 1e-6)) * 2.0  # norm -> gelu -> an op of its own
    _, ops, kernels = _counts(fn, x, scale)
    # forward: the norm's y, gelu's output, the product; backward: the product's gradient, gelu's
    # dx, the norm's dx and dscale
    assert kernels == _bytes(x, x, x) + _bytes(x, x, x, scale)


def test_the_gpu_profiles_count_kernels_and_the_cpu_profile_every_op():
    w = Written(ops=10, kernels=4)
    assert [w.on(PROFILES[p]) for p in ("a100", "h100", "h200", "cpu")] == [4, 4, 4, 10]
