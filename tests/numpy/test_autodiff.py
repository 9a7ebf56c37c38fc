"""The numpy backend's local ops and their gradients against JAX's (an independent autodiff),
fp32, on fresh random inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parlay.backends.jax.ops import JaxLocal
from parlay.backends.numpy import autodiff as ad
from parlay.backends.numpy.ops import NumpyLocal

N, J = NumpyLocal(), JaxLocal()
R = np.random.default_rng(0)
f32 = lambda *s: R.standard_normal(s).astype(np.float32)

CASES = {
    "einsum": (lambda L, a, b: L.einsum("bsh,hk->bks", a, b), [f32(2, 3, 4), f32(4, 5)]),
    "einsum-sum-away": (lambda L, a, b: L.einsum("ij,jk->", a, b), [f32(3, 4), f32(4, 2)]),
    "gelu": (lambda L, a: L.gelu(a), [f32(3, 5)]),
    "silu": (lambda L, a: L.silu(a), [f32(3, 5)]),
    "relu": (lambda L, a: L.relu(a), [f32(3, 5)]),
    "tanh": (lambda L, a: L.tanh(a), [f32(3, 5)]),
    "softmax": (lambda L, a: L.softmax(a, 1), [f32(3, 5, 2)]),
    "rms_norm": (lambda L, a, s: L.rms_norm(a, s, 1e-5), [f32(2, 3, 8), f32(8)]),
    "layer_norm": (lambda L, a, s, b: L.layer_norm(a, s, b, 1e-5), [f32(2, 3, 8), f32(8), f32(8)]),
    "take": (lambda L, t: L.take(t, np.array([[1, 0, 3], [3, 3, 2]])), [f32(4, 5)]),
    "take_last": (lambda L, x: L.take_last(x, np.array([[1, 0], [3, 2]])), [f32(2, 2, 4)]),
    "rotary": (lambda L, x: L.rotary(x, *(np.float32(np.cos(t)) for t in [np.arange(8).reshape(4, 2)] * 2)),
               [f32(2, 4, 3, 4)]),
    "attention-gqa": (lambda L, q, k, v: L.attention(q, k, v, causal=True), [f32(2, 5, 4, 3), f32(2, 5, 2, 3),
                                                                              f32(2, 5, 2, 3)]),
    "attention-full": (lambda L, q, k, v: L.attention(q, k, v, causal=False), [f32(1, 4, 2, 3)] * 3),
    "rearrange": (lambda L, x: L.rearrange(x, "b (h w) c -> b c h w", dict(h=2, w=3)), [f32(2, 6, 4)]),
    "cross_entropy": (lambda L, l: L.cross_entropy(l, np.array([[1, 4], [0, 2]])), [f32(2, 2, 5)]),
    "cross_entropy-rows": (lambda L, l: L.cross_entropy(l, np.array([1, 4, 0])), [f32(3, 5)]),
    "sum-exp-log-rsqrt": (lambda L, a: L.log(L.sum(L.exp(a), 1)) * L.rsqrt(L.sum(a * a, 0) + 1.0),
                          [f32(3, 3)]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_values_and_gradients_equal_jax(name):
    fn, args = CASES[name]
    vars_ = [ad.Var(a) for a in args]
    out = fn(N, *vars_)
    cot = f32(*np.shape(ad.value(out)))
    grads = ad.grad([out], vars_, seeds=[cot])
    ref, vjp = jax.vjp(lambda *xs: fn(J, *xs), *(jnp.asarray(a) for a in args))
    assert np.allclose(ad.value(out), ref, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, vjp(jnp.asarray(cot))):
        assert np.allclose(g, r, rtol=1e-4, atol=1e-5 * float(np.abs(r).max() + 1e-30)), name


def test_several_outputs_seed_their_own_cotangents():
    x = ad.Var(np.float32([1.0, 2.0]))
    y1, y2 = x * 3.0, x * x
    (g,) = ad.grad([y1, y2], [x], seeds=[np.float32([1, 1]), np.float32([2, 0])])
    assert np.array_equal(g, [3 + 4 * 1.0, 3 + 0.0])
    assert ad.grad([y1], [ad.Var(np.ones(2))]) == [None]  # nothing depends on an unused leaf
