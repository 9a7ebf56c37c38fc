"""Ring attention (context parallelism), written once: the sequence stays split over the ring's
mesh axes inside attention, K and V blocks travel around the ring, and each rank merges the
partial softmax results of its queries with their log-sum-exp (the online softmax).

The forward and the backward are both here, on plain local arrays through ``LocalOps`` and a
``shift`` (send this rank's block to the next member of its ring, receive the previous one's).
A backend runs them as one op with its own backward (``Comm.custom``): the backward recomputes
each block's probabilities from the saved log-sum-exp (flash attention's backward), so no rank
ever holds more than one (block x block) score tile per step, and no S x S buffer.

Forward, on a ring of n ranks, rank r (its position in the ring):

    step 0: its own K, V block; steps 1..n-1: the block of rank (r - i) mod n, shifted in.
    o, lse  <-  merge(o, lse, block_o, block_lse):  lse' = logaddexp(lse, block_lse),
                o' = o exp(lse - lse') + block_o exp(block_lse - lse')

Backward: delta = rowsum(do * o); per block p = exp(s - lse), dv += p^T do, ds = p (do v^T -
delta), dq += ds k, dk += ds^T q. dK and dV accumulate in buffers that travel with K and V and
take one last shift home (n shifts for dK, dV; n - 1 for K, V).

Load balance (``zigzag``): with a causal mask and the sequence split into n contiguous blocks,
rank r's queries see r + 1/2 blocks of keys, so the last rank does about twice the mean. Zigzag
splits the sequence into 2n chunks and gives rank r chunks r and 2n-1-r (``zigzag_order``; the
data is laid out in that order once, at the input). Then step 0 is the rank's local causal
block, and every later step is exactly two (chunk x chunk) pairs on every rank: the whole query
block against the first half of the received K/V (when the sender precedes it), or the second
half of the queries against the whole received block (when it follows). Both contain the pair
(second query half, first K/V half); the other pair is chosen by a select, so every rank runs the
same program (SPMD: JAX traces one program for all ranks).

Each step waits for the previous one's merge, and the backward's tiles for the output's gradient
(``LocalOps.barrier``), so a compiler may not hold two steps' tiles, or compute the backward's
before it needs them. XLA's CPU backend measured the same temporaries with and without it
(benchmarks/ring_sequence.py): what grows there is each step's own (s/n)^2 tile.

Every statistic (scores, max, log-sum-exp, the merged output, dq, dk, dv) is float32; the two
matmuls of a block take their operands in the inputs' dtype.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import numpy as np

__all__ = ["Ring", "SeqOrder", "SEQ_DIMS", "seq_dim", "zigzag_order", "ring_forward", "ring_backward", "ring_positions", "ring_work",
           "ring_traffic"]

SEQ_DIMS = ("seq", "input_seq")  # the logical dims of an input that a zigzag layout permutes
NEG = -1e30  # a masked score: exp(NEG - anything finite) is 0 in float32, and NEG - NEG is no NaN


@dataclass(frozen=True)
class Ring:
    """One ring attention: ``n`` ranks over mesh ``axes``, ``causal``, ``zigzag`` (the sequence
    laid out in ``zigzag_order``: causal rings then balance), ``rows``: each rank's sequence
    block (queries and keys alike)."""

    axes: tuple[str, ...]
    n: int
    causal: bool
    zigzag: bool
    rows: int

    def __post_init__(self):
        if self.zigzag and self.rows % 2:
            raise ValueError(f"ring attention over {self.axes}: a zigzag block holds two chunks, but each rank holds "
                             f"{self.rows} positions (odd); use a sequence divisible by {2 * self.n}.")


@dataclass(frozen=True)
class SeqOrder:
    """The sequence laid out in zigzag order over mesh ``axes`` (``n`` ranks in all) for a
    sequence of ``seq`` positions (``Strategy.zigzag``): the explicit lowerings permute every
    input's ``seq`` dim by ``perm`` once; the executor's ops that see positions follow it."""

    axes: tuple[str, ...]
    n: int
    seq: int

    @functools.cached_property
    def perm(self) -> np.ndarray:
        return zigzag_order(self.seq, self.n)


def seq_dim(dims) -> int | None:
    """Which of an input's logical ``dims`` is its sequence (named in ``SEQ_DIMS``), or None."""
    return next((i for i, n in enumerate(dims) if n in SEQ_DIMS), None)


def zigzag_order(seq: int, n: int) -> np.ndarray:
    """The sequence in zigzag order for a ring of ``n``: ``order[i]`` is the original position of
    position ``i`` of the laid-out sequence. Its n contiguous blocks are chunks (r, 2n-1-r)."""
    if seq % (2 * n):
        raise ValueError(f"zigzag over a ring of {n} splits the sequence into {2 * n} chunks; the sequence has "
                         f"{seq} positions, not divisible by {2 * n}. Use a sequence length divisible by {2 * n}, or "
                         f"the ring without load balancing (ring_contiguous).")
    c = seq // (2 * n)
    chunks = np.arange(seq).reshape(2 * n, c)
    return np.concatenate([np.concatenate([chunks[r], chunks[2 * n - 1 - r]]) for r in range(n)])


def _select(L, cond, x, y):
    """``x`` where ``cond`` (a per-rank scalar) else ``y``: a Python bool picks; a traced or
    per-rank one selects elementwise (every rank runs the same program)."""
    if isinstance(cond, (bool, np.bool_)):
        return x if cond else y
    return L.where(cond, x, y)


def ring_positions(L, ring: Ring, index, rows: int, block=None):
    """The original sequence positions of ``rows`` local rows of ring member ``block`` (default:
    this rank, ``index``), int32, shape (rows,)."""
    block = index if block is None else block
    i = L.iota((rows,), 0)
    if not ring.zigzag:
        return i + block * rows
    c = rows // 2
    return L.where(i < c, i + block * c, i - c + (2 * ring.n - 1 - block) * c)


def _mask(L, ring: Ring, index, src, rows: int):
    """(rows, rows) bool: query (this rank's) may see key (ring member ``src``'s), or None."""
    if not ring.causal:
        return None
    pq = ring_positions(L, ring, index, rows)
    pk = ring_positions(L, ring, index, rows, src)
    return pq[:, None] >= pk[None, :]


# -- one block ------------------------------------------------------------------------------------

def _grouped(L, x, kv_heads: int):
    """(B, R, H, D) queries as (B, R, K, G, D): kv head j serves query heads j*G .. j*G+G-1."""
    return L.rearrange(x, "b r (k g) d -> b r k g d", {"k": kv_heads, "g": x.shape[2] // kv_heads})


def _scores(L, q, k, mask, scale):
    s = L.astype(L.einsum("brkgd,bckd->brkgc", q, k), "float32") * scale
    return s if mask is None else L.where(mask[None, :, None, None, :], s, NEG)


def _block_forward(L, q, k, v, mask, scale):
    """Grouped q (B, R, K, G, D), k, v (B, C, K, D): the block's output (B, R, K, G, D) and
    log-sum-exp (B, R, K, G, 1), float32."""
    s = _scores(L, q, k, mask, scale)
    m = L.max(s, -1, keepdim=True)
    e = L.exp(s - m)
    total = L.sum(e, -1, keepdim=True)
    o = L.astype(L.einsum("brkgc,bckd->brkgd", L.astype(e / total, _dtype(v)), v), "float32")
    return o, m + L.log(total)


def _block_backward(L, q, k, v, do, lse, delta, mask, scale):
    """The block's dq (B, R, K, G, D), dk, dv (B, C, K, D), float32."""
    p = L.exp(_scores(L, q, k, mask, scale) - lse)
    pd = L.astype(p, _dtype(v))
    dv = L.astype(L.einsum("brkgc,brkgd->bckd", pd, L.astype(do, _dtype(v))), "float32")
    dp = L.astype(L.einsum("brkgd,bckd->brkgc", L.astype(do, _dtype(v)), v), "float32")
    ds = L.astype(p * (dp - delta) * scale, _dtype(q))
    dq = L.astype(L.einsum("brkgc,bckd->brkgd", ds, k), "float32")
    dk = L.astype(L.einsum("brkgc,brkgd->bckd", ds, q), "float32")
    return dq, dk, dv


def _merge(L, o, lse, bo, blse):
    top = L.where(lse > blse, lse, blse)
    a, b = L.exp(lse - top), L.exp(blse - top)
    new = top + L.log(a + b)
    return o * L.exp(lse - new) + bo * L.exp(blse - new), new


def _dtype(x) -> str:
    return str(x.dtype).removeprefix("torch.")


def _halves(x, c):
    return x[:, :c], x[:, c:]


# -- the ring -------------------------------------------------------------------------------------

def ring_forward(L, shift: Callable, index, ring: Ring, q, k, v):
    """q (B, R, H, D), k, v (B, R, K, D), this rank's blocks; ``index``: its place in the ring.
    Returns the output (B, R, H, D) in q's dtype and the log-sum-exp (B, R, K, G, 1), float32."""
    kv_heads, scale = k.shape[2], 1.0 / float(np.sqrt(q.shape[-1]))
    qg, R = _grouped(L, q, kv_heads), q.shape[1]
    o, lse = _block_forward(L, qg, k, v, _mask(L, ring, index, index, R), scale)
    if ring.zigzag and ring.causal:
        c = R // 2
        (q0, q1), (o0, o1), (l0, l1) = _halves(qg, c), _halves(o, c), _halves(lse, c)
        for i in range(1, ring.n):
            k, v, o0, o1, l0, l1 = L.barrier((shift(k), shift(v), o0, o1, l0, l1))
            (k0, k1), (v0, v1) = _halves(k, c), _halves(v, c)
            o1, l1 = _merge(L, o1, l1, *_block_forward(L, q1, k0, v0, None, scale))  # every rank, every step
            first = index >= i  # the sender precedes this rank: all queries against its first chunk
            by, bl = _block_forward(L, _select(L, first, q0, q1), _select(L, first, k0, k1),
                                    _select(L, first, v0, v1), None, scale)
            m0, n0 = _merge(L, o0, l0, by, bl)
            m1, n1 = _merge(L, o1, l1, by, bl)
            o0, l0 = _select(L, first, m0, o0), _select(L, first, n0, l0)
            o1, l1 = _select(L, first, o1, m1), _select(L, first, l1, n1)
        o, lse = L.concat([o0, o1], 1), L.concat([l0, l1], 1)
    else:
        for i in range(1, ring.n):
            k, v, o, lse = L.barrier((shift(k), shift(v), o, lse))
            src = _select(L, index >= i, index - i, index - i + ring.n)
            o, lse = _merge(L, o, lse, *_block_forward(L, qg, k, v, _mask(L, ring, index, src, R), scale))
    return L.astype(L.rearrange(o, "b r k g d -> b r (k g) d", {}), _dtype(q)), lse


def ring_backward(L, shift: Callable, index, ring: Ring, q, k, v, o, lse, do):
    """The gradients (dq, dk, dv) of ``ring_forward``'s output, in q's, k's and v's dtypes."""
    kv_heads, scale = k.shape[2], 1.0 / float(np.sqrt(q.shape[-1]))
    qg, og, dog = (_grouped(L, t, kv_heads) for t in (q, o, do))
    delta = L.sum(L.astype(dog, "float32") * L.astype(og, "float32"), -1, keepdim=True)
    # The tiles wait for the output's gradient (from the residuals alone they could be computed,
    # and kept, as early as the forward).
    qg, k, v, lse, dog, delta = L.barrier((qg, k, v, lse, dog, delta))
    R = q.shape[1]
    dq, dk, dv = _block_backward(L, qg, k, v, dog, lse, delta, _mask(L, ring, index, index, R), scale)
    if ring.zigzag and ring.causal:
        c = R // 2
        (q0, q1), (do0, do1), (l0, l1), (d0, d1) = (_halves(t, c) for t in (qg, dog, lse, delta))
        (dq0, dq1), (dk0, dk1), (dv0, dv1) = _halves(dq, c), _halves(dk, c), _halves(dv, c)
        for i in range(1, ring.n):
            k, v, dk0, dk1, dv0, dv1 = (shift(t) for t in (k, v, dk0, dk1, dv0, dv1))
            k, v, dk0, dk1, dv0, dv1, dq0, dq1 = L.barrier((k, v, dk0, dk1, dv0, dv1, dq0, dq1))
            (k0, k1), (v0, v1) = _halves(k, c), _halves(v, c)
            gq, gk, gv = _block_backward(L, q1, k0, v0, do1, l1, d1, None, scale)
            dq1, dk0, dv0 = dq1 + gq, dk0 + gk, dv0 + gv
            first = index >= i
            pick = lambda a, b: _select(L, first, a, b)
            gq, gk, gv = _block_backward(L, pick(q0, q1), pick(k0, k1), pick(v0, v1), pick(do0, do1), pick(l0, l1),
                                         pick(d0, d1), None, scale)
            zero = gq * 0.0
            dq0, dq1 = dq0 + pick(gq, zero), dq1 + pick(zero, gq)
            zk, zv = gk * 0.0, gv * 0.0
            dk0, dk1 = dk0 + pick(gk, zk), dk1 + pick(zk, gk)
            dv0, dv1 = dv0 + pick(gv, zv), dv1 + pick(zv, gv)
        dq, dk, dv = L.concat([dq0, dq1], 1), L.concat([dk0, dk1], 1), L.concat([dv0, dv1], 1)
    else:
        for i in range(1, ring.n):
            k, v, dk, dv, dq = L.barrier(tuple(shift(t) for t in (k, v, dk, dv)) + (dq,))
            src = _select(L, index >= i, index - i, index - i + ring.n)
            gq, gk, gv = _block_backward(L, qg, k, v, dog, lse, delta, _mask(L, ring, index, src, R), scale)
            dq, dk, dv = dq + gq, dk + gk, dv + gv
    if ring.n > 1:  # the accumulators of K and V blocks go home
        dk, dv = shift(dk), shift(dv)
    dq = L.rearrange(dq, "b r k g d -> b r (k g) d", {})
    return L.astype(dq, _dtype(q)), L.astype(dk, _dtype(k)), L.astype(dv, _dtype(v))


# -- accounting -------------------------------------------------------------------------------------

def ring_work(n: int, seq: int, *, causal: bool, zigzag: bool) -> list[dict]:
    """Per ring member: ``computed`` (query x key pairs whose scores it computes) and ``useful``
    (those the mask keeps), over the whole forward, counted from the schedule ``ring_forward``
    runs (the same blocks, the same masks, in numpy)."""
    rows = seq // n
    order = zigzag_order(seq, n) if zigzag else np.arange(seq)
    pos = order.reshape(n, rows)
    out = []
    for r in range(n):
        computed = useful = 0

        def pairs(qi, ki, src):
            nonlocal computed, useful
            computed += len(qi) * len(ki)
            keep = pos[r][qi][:, None] >= pos[src][ki][None, :] if causal else np.ones((len(qi), len(ki)), bool)
            useful += int(keep.sum())

        everything = np.arange(rows)
        pairs(everything, everything, r)
        c = rows // 2
        first, second = np.arange(c), np.arange(c, rows)
        for i in range(1, n):
            src = (r - i) % n
            if zigzag and causal:
                pairs(second, first, src)
                pairs(first, first, src) if r >= i else pairs(second, second, src)
            else:
                pairs(everything, everything, src)
        out.append({"computed": computed, "useful": useful})
    return out


def ring_traffic(n: int, *, batch: int, seq: int, kv_heads: int, head_dim: int, itemsize: int) -> dict:
    """Bytes one rank sends in one ring attention: ``forward`` (n - 1 shifts of its K and V
    blocks: 2 (n-1)/n s d_kv b elements, an all-gather's volume) and ``backward`` (n - 1 shifts of
    K and V, n of the float32 dK and dV accumulators)."""
    block = batch * (seq // n) * kv_heads * head_dim
    return {"forward": 2 * (n - 1) * block * itemsize,
            "backward": 2 * (n - 1) * block * itemsize + 2 * n * block * 4}
