"""The neutral ops' local math in numpy, differentiable through ``autodiff``.

``NumpyLocal`` is parlay's ``LocalOps`` on plain arrays and ``autodiff.Var``s: the single-device
reference (``DenseOps(NumpyLocal())``) and, mapped over ranks by ``PerRankLocal``, the local math
of the simulated sharded run. Each op is written from its definition, with nothing fused.
"""

from __future__ import annotations

import math

import numpy as np

from ...core.layouts import parse_rearrange
from ...core.ops import vocab_cross_entropy
from . import autodiff as ad

__all__ = ["NumpyLocal", "PerRank", "PerRankLocal"]


class NumpyLocal:
    """``LocalOps`` for numpy (float32 in, float32 out)."""

    def constant(self, value):
        return np.asarray(value)

    def einsum(self, equation, *xs):
        return ad.einsum(equation, *xs)

    def gelu(self, x):
        c = np.float32(math.sqrt(2 / math.pi))
        return 0.5 * x * (1.0 + ad.tanh(c * (x + 0.044715 * (x * x * x))))

    def silu(self, x):
        return x / (1.0 + ad.exp(-x))

    def relu(self, x):
        return ad.where(ad.value(x) > 0, x, x * 0.0)

    def tanh(self, x):
        return ad.tanh(x)

    def softmax(self, x, dim):
        e = ad.exp(x - np.max(ad.value(x), axis=dim, keepdims=True))
        return e / ad.sum(e, dim, keepdims=True)

    def sum(self, x, dim, *, keepdim=False):
        return ad.sum(x, dim, keepdims=keepdim)

    def max(self, x, dim, *, keepdim=False):
        return np.max(ad.value(x), axis=dim, keepdims=keepdim)

    def exp(self, x):
        return ad.exp(x)

    def log(self, x):
        return ad.log(x)

    def rsqrt(self, x):
        return ad.rsqrt(x)

    def rms_norm(self, x, scale, eps):
        ms = ad.sum(x * x, -1, keepdims=True) * (1.0 / x.shape[-1])
        return x * ad.rsqrt(ms + eps) * scale

    def layer_norm(self, x, scale, bias, eps):
        n = 1.0 / x.shape[-1]
        centered = x - ad.sum(x, -1, keepdims=True) * n
        var = ad.sum(centered * centered, -1, keepdims=True) * n
        return centered * ad.rsqrt(var + eps) * scale + bias

    def take(self, table, ids):
        return ad.take(table, ids)

    def take_last(self, x, ids):
        return ad.take_last(x, ids)

    def where(self, mask, x, y):
        return ad.where(mask, x, y)

    def concat(self, xs, dim):
        return ad.concat(list(xs), dim)

    def barrier(self, xs):
        return xs  # eager: each step runs when written

    def cast(self, x, like):
        return np.asarray(ad.value(x)).astype(ad.value(like).dtype)

    def astype(self, x, dtype):
        if dtype != "float32":  # the sessions refuse mixed precision before this (core/precision.py)
            raise ValueError(f"the numpy simulator computes in float32 only, not {dtype}.")
        return x

    def iota(self, shape, dim):
        view = [1] * len(shape)
        view[dim] = shape[dim]
        return np.arange(shape[dim], dtype=np.int32).reshape(view)

    def rotary(self, x, cos, sin):
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]  # (B, S, H, D/2) each
        c, s = ad.value(cos)[None, :, None, :], ad.value(sin)[None, :, None, :]
        return ad.concat([x1 * c - x2 * s, x1 * s + x2 * c], -1)

    def attention(self, q, k, v, *, causal=True):
        B, S, H, D = q.shape
        group = H // k.shape[2]
        k, v = ad.repeat(k, group, 2), ad.repeat(v, group, 2)  # kv head j serves query heads j*group..
        scores = ad.einsum("bqhd,bkhd->bhqk", q, k) * np.float32(1 / math.sqrt(D))
        if causal:
            scores = ad.where(np.tril(np.ones((S, S), dtype=bool)), scores, np.float32(-np.inf))
        return ad.einsum("bhqk,bkhd->bqhd", self.softmax(scores, 3), v)

    def rearrange(self, x, pattern, sizes):
        r = parse_rearrange(pattern, tuple(x.shape), sizes)
        size = dict(r.sizes)
        names = [n for g in r.lhs for n in g]
        flat = ad.reshape(x, tuple(size[n] for n in names))  # one dim per name
        out_names = [n for g in r.rhs for n in g]
        moved = ad.transpose(flat, tuple(names.index(n) for n in out_names))
        return ad.reshape(moved, r.out_shape)

    def vocab_cross_entropy(self, logits, ids, hit, combine):
        return vocab_cross_entropy(self, logits, ids, hit, combine)

    def cross_entropy(self, logits, targets):
        rows = self.vocab_cross_entropy(logits, np.asarray(targets), np.ones(np.shape(targets), bool),
                                        lambda m, se, p: (m, se, p))
        return ad.sum(ad.reshape(rows, (-1,)), 0) * (1.0 / int(np.prod(np.shape(targets))))


class PerRank:
    """One value per rank of a simulated mesh (arrays or ``Var``s); operators act rank by rank."""

    __slots__ = ("values",)
    __array_priority__ = 2000

    def __init__(self, values):
        self.values = list(values)

    def __len__(self):
        return len(self.values)

    def __getitem__(self, index):
        if isinstance(index, int):
            return self.values[index]
        return PerRank(v[index] for v in self.values)

    @property
    def shape(self):
        return np.shape(ad.value(self.values[0]))

    @property
    def dtype(self):
        return np.asarray(ad.value(self.values[0])).dtype

    def _map(self, other, fn):
        if isinstance(other, PerRank):
            return PerRank(fn(a, b) for a, b in zip(self.values, other.values))
        return PerRank(fn(a, other) for a in self.values)

    def _rmap(self, other, fn):
        return PerRank(fn(other, a) for a in self.values)

    __add__ = lambda s, o: s._map(o, lambda a, b: a + b)
    __radd__ = lambda s, o: s._rmap(o, lambda a, b: a + b)
    __sub__ = lambda s, o: s._map(o, lambda a, b: a - b)
    __rsub__ = lambda s, o: s._rmap(o, lambda a, b: a - b)
    __mul__ = lambda s, o: s._map(o, lambda a, b: a * b)
    __rmul__ = lambda s, o: s._rmap(o, lambda a, b: a * b)
    __truediv__ = lambda s, o: s._map(o, lambda a, b: a / b)
    __rtruediv__ = lambda s, o: s._rmap(o, lambda a, b: a / b)
    __lt__ = lambda s, o: s._map(o, lambda a, b: a < b)
    __le__ = lambda s, o: s._map(o, lambda a, b: a <= b)
    __gt__ = lambda s, o: s._map(o, lambda a, b: a > b)
    __ge__ = lambda s, o: s._map(o, lambda a, b: a >= b)
    __eq__ = lambda s, o: s._map(o, lambda a, b: a == b)
    __and__ = lambda s, o: s._map(o, lambda a, b: a & b)
    __or__ = lambda s, o: s._map(o, lambda a, b: a | b)
    __xor__ = lambda s, o: s._map(o, lambda a, b: a ^ b)
    __rxor__ = lambda s, o: s._rmap(o, lambda a, b: a ^ b)
    __rshift__ = lambda s, o: s._map(o, lambda a, b: a >> b)
    __neg__ = lambda s: PerRank(-v for v in s.values)
    __hash__ = None


class PerRankLocal:
    """``LocalOps`` on ``PerRank`` values: each op applied rank by rank (with ``combine`` called
    once, on all ranks' statistics, where the collectives are)."""

    def __init__(self, local: NumpyLocal, ranks: int):
        self._local, self.ranks = local, ranks

    def __getattr__(self, name):
        fn = getattr(self._local, name)

        def mapped(*args, **kwargs):
            if not any(isinstance(a, PerRank) for a in (*args, *kwargs.values())):
                return fn(*args, **kwargs)  # the same on every rank (iota, casts of constants)
            n = self.ranks
            pick = lambda a, r: a.values[r] if isinstance(a, PerRank) else a
            return PerRank(fn(*(pick(a, r) for a in args), **{k: pick(v, r) for k, v in kwargs.items()})
                           for r in range(n))

        return mapped

    def constant(self, value):
        return PerRank([np.asarray(value)] * self.ranks)

    def concat(self, xs, dim):
        xs = [x if isinstance(x, PerRank) else PerRank([x] * self.ranks) for x in xs]
        return PerRank(self._local.concat([x.values[r] for x in xs], dim) for r in range(self.ranks))

    def vocab_cross_entropy(self, logits, ids, hit, combine):
        return vocab_cross_entropy(self, logits, ids, hit, combine)
