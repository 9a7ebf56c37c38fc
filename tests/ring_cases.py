"""Ring attention's op checks, shared by the numpy, JAX and torch tests (and importable by spawned
gloo ranks): random global q, k, v and output cotangent, laid out on a mesh; the full-attention
reference in float64."""

from __future__ import annotations

import numpy as np

from parlay import Mesh
from parlay.core.ring import Ring, ring_backward, ring_forward, zigzag_order

# (mesh axes, ring axes, causal, zigzag, heads, kv_heads): rings of 1, 2, 4 and 8 ranks, a ring over
# two mesh axes, a data axis the ring does not use, grouped-query heads.
CASES = [
    ({"cp": 2}, ("cp",), True, True, 4, 2),
    ({"cp": 2}, ("cp",), False, False, 4, 4),
    ({"dp": 2, "cp": 4}, ("cp",), True, True, 6, 2),
    ({"cp": 4, "dp": 2}, ("cp",), True, False, 4, 1),
    ({"cp": 4}, ("cp",), False, True, 4, 2),
    ({"cp": 8}, ("cp",), True, True, 2, 2),
    ({"cp": 8}, ("cp",), True, False, 4, 2),
    ({"a": 2, "dp": 2, "b": 2}, ("a", "b"), True, True, 4, 2),
]


def key(case) -> str:
    axes, ring, causal, zigzag, h, k = case
    return f"{axes}/{','.join(ring)}/{'causal' if causal else 'full'}/{'zigzag' if zigzag else 'contiguous'}/{h}q{k}kv"


def arrays(case, seed=0):
    """Global q, k, v, do (B, S, H, D) float32, S = 4 rows per ring member."""
    axes, ring_axes, _, _, heads, kv_heads = case
    n = Mesh(axes).group_size(ring_axes)
    rng = np.random.default_rng(seed)
    B, S, D = 2, 4 * n, 8
    shape = lambda h: (B, S, h, D)
    return [rng.standard_normal(shape(h)).astype(np.float32) for h in (heads, kv_heads, kv_heads, heads)]


def ring_of(case) -> Ring:
    axes, ring_axes, causal, zigzag, _, _ = case
    n = Mesh(axes).group_size(ring_axes)
    return Ring(tuple(ring_axes), n, causal, zigzag, 4)


def order(case) -> np.ndarray:
    ring = ring_of(case)
    return zigzag_order(4 * ring.n, ring.n) if ring.zigzag else np.arange(4 * ring.n)


def block(case, x: np.ndarray, rank: int) -> np.ndarray:
    """Rank ``rank``'s sequence block of global ``x`` (in the case's order)."""
    mesh, ring = Mesh(case[0]), ring_of(case)
    i = mesh.index_in_group(rank, ring.axes)
    return np.ascontiguousarray(x[:, order(case)][:, i * ring.rows:(i + 1) * ring.rows])


def assemble(case, blocks: list) -> np.ndarray:
    """The global array (original order) from every rank's block; ranks sharing a block agree."""
    mesh, ring = Mesh(case[0]), ring_of(case)
    first = np.asarray(blocks[0])
    out = np.full((first.shape[0], ring.rows * ring.n) + first.shape[2:], np.nan)
    for r, b in enumerate(blocks):
        i = mesh.index_in_group(r, ring.axes)
        rows = order(case)[i * ring.rows:(i + 1) * ring.rows]
        done = out[:, rows]
        assert np.isnan(done).all() or np.array_equal(done, b), "ranks holding the same block disagree"
        out[:, rows] = b
    return out


def reference(q, k, v, do, causal: bool):
    """Full attention in float64: o (B, S, H, D), lse (B, S, H), dq, dk, dv."""
    q, k, v, do = (x.astype(np.float64) for x in (q, k, v, do))
    B, S, H, D = q.shape
    g = H // k.shape[2]
    kk, vv = np.repeat(k, g, 2), np.repeat(v, g, 2)
    s = np.einsum("bqhd,bkhd->bhqk", q, kk) / np.sqrt(D)
    if causal:
        s = np.where(np.tril(np.ones((S, S), bool)), s, -np.inf)
    lse = np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1, keepdims=True)) + s.max(-1, keepdims=True)
    p = np.exp(s - lse)
    o = np.einsum("bhqk,bkhd->bqhd", p, vv)
    dp = np.einsum("bqhd,bkhd->bhqk", do, vv)
    ds = p * (dp - (p * dp).sum(-1, keepdims=True)) / np.sqrt(D)
    dq = np.einsum("bhqk,bkhd->bqhd", ds, kk)
    fold = lambda x: x.reshape(B, S, k.shape[2], g, D).sum(3)
    dk, dv = fold(np.einsum("bhqk,bqhd->bkhd", ds, q)), fold(np.einsum("bhqk,bqhd->bkhd", p, do))
    return o, lse[..., 0].transpose(0, 2, 1), dq, dk, dv


def local_run(L, comm, case, q, k, v, do):
    """ring_forward and ring_backward on this rank's blocks: (o, lse as (B, R, H), dq, dk, dv)."""
    ring = ring_of(case)
    index = comm.axis_index(ring.axes)
    o, lse = ring_forward(L, lambda t: comm.shift(t, ring.axes), index, ring, q, k, v)
    grads = ring_backward(L, lambda t: comm.shift(t, ring.axes, backward=True), index, ring, q, k, v, o, lse, do)
    lse = L.rearrange(lse, "b r k g o -> b r (k g o)", {})
    return (o, lse, *grads)


def check(case, outs, tol=2e-5) -> dict:
    """Each of o, lse, dq, dk, dv against the reference: the largest difference over the largest
    reference element, asserted below ``tol``; returns them."""
    want = reference(*arrays(case), causal=case[2])
    errs = {}
    for name, got, ref in zip(("o", "lse", "dq", "dk", "dv"), outs, want):
        assert got.shape == ref.shape, (name, got.shape, ref.shape)
        errs[name] = float(np.abs(got - ref).max() / np.abs(ref).max())
    assert max(errs.values()) < tol, (key(case), errs)
    return errs
