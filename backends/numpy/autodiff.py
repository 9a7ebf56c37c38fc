"""A small reverse-mode autodiff over numpy arrays: enough for parlay's ops, no more.

``Var`` wraps an array and remembers how it was made; ``grad(out, leaves)`` runs the chain rule
backward from a scalar. Plain numpy arrays (token ids, masks, constants) take part as constants.
Collectives define their own transposes with ``custom``. The point is to be readable and
obviously right (every rule is a few lines of textbook calculus), not fast.
"""

from __future__ import annotations

import itertools
from typing import Callable, Sequence

import numpy as np

__all__ = ["Var", "value", "custom", "grad", "einsum", "exp", "log", "tanh", "rsqrt", "sum", "where", "take",
           "take_last", "reshape", "transpose", "concat", "repeat", "stop"]


_created = itertools.count()


class Var:
    """An array in the computation graph. ``parents``: the Vars it was made from; ``vjp(g)``
    returns their cotangents (None where there is none)."""

    __slots__ = ("value", "parents", "vjp", "n")
    __array_priority__ = 1000  # numpy operators defer to Var's

    def __init__(self, value, parents: Sequence["Var"] = (), vjp: Callable | None = None):
        self.value = np.asarray(value)
        self.parents, self.vjp = tuple(parents), vjp
        self.n = next(_created)  # creation order: cotangents are summed in it (see grad)

    shape = property(lambda self: self.value.shape)
    dtype = property(lambda self: self.value.dtype)
    ndim = property(lambda self: self.value.ndim)

    def __repr__(self) -> str:
        return f"Var({self.value!r})"

    # arithmetic (broadcasting as numpy)
    def __add__(self, o): return _binary(self, o, np.add, lambda g, a, b: (g, g))
    def __radd__(self, o): return _binary(o, self, np.add, lambda g, a, b: (g, g))
    def __sub__(self, o): return _binary(self, o, np.subtract, lambda g, a, b: (g, -g))
    def __rsub__(self, o): return _binary(o, self, np.subtract, lambda g, a, b: (g, -g))
    def __mul__(self, o): return _binary(self, o, np.multiply, lambda g, a, b: (g * b, g * a))
    def __rmul__(self, o): return _binary(o, self, np.multiply, lambda g, a, b: (g * b, g * a))
    def __truediv__(self, o): return _binary(self, o, np.divide, lambda g, a, b: (g / b, -g * a / (b * b)))
    def __rtruediv__(self, o): return _binary(o, self, np.divide, lambda g, a, b: (g / b, -g * a / (b * b)))
    def __neg__(self): return Var(-self.value, (self,), lambda g: (-g,))

    # comparisons and integer bit operations give constants
    def __lt__(self, o): return self.value < value(o)
    def __le__(self, o): return self.value <= value(o)
    def __gt__(self, o): return self.value > value(o)
    def __ge__(self, o): return self.value >= value(o)

    def __getitem__(self, index):
        def vjp(g):
            out = np.zeros_like(self.value)
            np.add.at(out, index, g)
            return (out,)
        return Var(self.value[index], (self,), vjp)


def value(x):
    return x.value if isinstance(x, Var) else x


def _unbroadcast(g: np.ndarray, shape: tuple) -> np.ndarray:
    while g.ndim > len(shape):
        g = g.sum(0)
    for d, n in enumerate(shape):
        if n == 1 and g.shape[d] != 1:
            g = g.sum(d, keepdims=True)
    return g


def _binary(a, b, fn, rule):
    av, bv = value(a), value(b)
    out = fn(av, bv)
    parents = [p for p in (a, b) if isinstance(p, Var)]
    if not parents:
        return out

    def vjp(g):
        ga, gb = rule(g, av, bv)
        grads = []
        if isinstance(a, Var):
            grads.append(_unbroadcast(np.asarray(ga), np.shape(av)))
        if isinstance(b, Var):
            grads.append(_unbroadcast(np.asarray(gb), np.shape(bv)))
        return tuple(grads)

    return Var(out, parents, vjp)


def _unary(x, fn, rule):
    xv = value(x)
    out = fn(xv)
    if not isinstance(x, Var):
        return out
    return Var(out, (x,), lambda g: (rule(g, xv, out),))


def custom(out, inputs: Sequence, vjp: Callable):
    """A node with a hand-written transpose: ``vjp(g)`` gives one cotangent per Var in ``inputs``."""
    parents = [x for x in inputs if isinstance(x, Var)]
    return Var(out, parents, vjp) if parents else np.asarray(out)


def stop(x):
    """The value without gradient."""
    return value(x)


def exp(x): return _unary(x, np.exp, lambda g, x, y: g * y)
def log(x): return _unary(x, np.log, lambda g, x, y: g / x)
def tanh(x): return _unary(x, np.tanh, lambda g, x, y: g * (1 - y * y))
def rsqrt(x): return _unary(x, lambda v: 1 / np.sqrt(v), lambda g, x, y: -0.5 * g * y / x)


def sum(x, axis, keepdims: bool = False):
    xv = value(x)
    out = np.sum(xv, axis=axis, keepdims=keepdims)
    if not isinstance(x, Var):
        return out

    def vjp(g):
        if not keepdims:
            g = np.expand_dims(g, axis)
        return (np.broadcast_to(g, xv.shape).copy(),)

    return Var(out, (x,), vjp)


def where(mask, a, b):
    mask = np.asarray(value(mask))
    av, bv = value(a), value(b)
    out = np.where(mask, av, bv)
    parents = [p for p in (a, b) if isinstance(p, Var)]
    if not parents:
        return out

    def vjp(g):
        grads = []
        if isinstance(a, Var):
            grads.append(_unbroadcast(np.where(mask, g, 0).astype(g.dtype), np.shape(av)))
        if isinstance(b, Var):
            grads.append(_unbroadcast(np.where(mask, 0, g).astype(g.dtype), np.shape(bv)))
        return tuple(grads)

    return Var(out, parents, vjp)


def einsum(equation: str, *xs):
    vals = [value(x) for x in xs]
    out = np.einsum(equation, *vals)
    if not any(isinstance(x, Var) for x in xs):
        return out
    lhs, out_letters = equation.replace(" ", "").split("->")
    terms = lhs.split(",")

    def vjp(g):
        grads = []
        for i, (x, term) in enumerate(zip(xs, terms)):
            if not isinstance(x, Var):
                continue
            others = [(t, v) for j, (t, v) in enumerate(zip(terms, vals)) if j != i]
            have = set(out_letters) | {c for t, _ in others for c in t}
            # Letters only this operand has were summed away: their cotangent is a broadcast.
            ones = [(c, np.ones(vals[i].shape[term.index(c)], g.dtype)) for c in dict.fromkeys(term) if c not in have]
            eq = ",".join([out_letters] + [t for t, _ in others] + [c for c, _ in ones]) + "->" + term
            grads.append(np.einsum(eq, g, *(v for _, v in others), *(o for _, o in ones)))
        return tuple(grads)

    return Var(out, [x for x in xs if isinstance(x, Var)], vjp)


def take(table, ids):
    """``table[ids]`` (rows of a (V, E) table)."""
    tv, ids = value(table), np.asarray(value(ids))
    out = tv[ids]
    if not isinstance(table, Var):
        return out

    def vjp(g):
        full = np.zeros_like(tv)
        np.add.at(full, ids, g)
        return (full,)

    return Var(out, (table,), vjp)


def take_last(x, ids):
    """``x[..., ids]``: one element of the last dim per leading position."""
    xv, ids = value(x), np.asarray(value(ids))
    out = np.take_along_axis(xv, ids[..., None], axis=-1)[..., 0]
    if not isinstance(x, Var):
        return out

    def vjp(g):
        full = np.zeros_like(xv)
        np.put_along_axis(full, ids[..., None], g[..., None], axis=-1)
        return (full,)

    return Var(out, (x,), vjp)


def reshape(x, shape):
    xv = value(x)
    out = xv.reshape(shape)
    return Var(out, (x,), lambda g: (g.reshape(xv.shape),)) if isinstance(x, Var) else out


def transpose(x, axes):
    xv = value(x)
    out = np.transpose(xv, axes)
    inverse = np.argsort(axes)
    return Var(out, (x,), lambda g: (np.transpose(g, inverse),)) if isinstance(x, Var) else out


def concat(xs, axis: int):
    vals = [value(x) for x in xs]
    out = np.concatenate(vals, axis=axis)
    if not any(isinstance(x, Var) for x in xs):
        return out
    cuts = np.cumsum([v.shape[axis] for v in vals])[:-1]

    def vjp(g):
        pieces = np.split(g, cuts, axis=axis)
        return tuple(p for x, p in zip(xs, pieces) if isinstance(x, Var))

    return Var(out, [x for x in xs if isinstance(x, Var)], vjp)


def repeat(x, n: int, axis: int):
    """``np.repeat``: each entry ``n`` times in a row (grouped-query heads)."""
    xv = value(x)
    out = np.repeat(xv, n, axis=axis)
    if not isinstance(x, Var):
        return out
    shape = xv.shape

    def vjp(g):
        g = np.moveaxis(g, axis, 0).reshape((shape[axis], n) + tuple(np.delete(g.shape, axis)))
        return (np.moveaxis(g.sum(1), 0, axis),)

    return Var(out, (x,), vjp)


def grad(outs: Var | Sequence[Var], leaves: Sequence[Var], seeds=None) -> list[np.ndarray | None]:
    """The cotangent of each leaf (None where nothing depends on it), backward from ``outs`` with
    cotangents ``seeds`` (default ones). Several outputs: one per rank of a simulated mesh."""
    outs = [outs] if isinstance(outs, Var) else list(outs)
    seeds = [np.ones_like(o.value) for o in outs] if seeds is None else [np.asarray(s) for s in seeds]
    order: list[Var] = []
    seen: set[int] = set()
    stack = [(o, False) for o in outs]
    while stack:  # iterative post-order: graphs here are thousands of nodes deep
        node, done = stack.pop()
        if done:
            order.append(node)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.append((node, True))
        stack.extend((p, False) for p in node.parents if id(p) not in seen)
    # Each node's cotangent is the sum of its consumers' contributions, added in the consumers'
    # creation order: the same order on every rank of a simulated mesh (ranks build their graphs
    # op by op in step), so replicas of a gradient come out with the same bits.
    parts: dict[int, list] = {}
    for i, (o, s) in enumerate(zip(outs, seeds)):
        parts.setdefault(id(o), []).append((-1 - i, s))
    keep = {id(leaf) for leaf in leaves}
    done: dict[int, np.ndarray] = {}
    for node in reversed(order):
        contributions = parts.pop(id(node), None)
        if contributions is None:
            continue
        contributions.sort(key=lambda c: c[0])
        g = contributions[0][1]
        for _, more in contributions[1:]:
            g = g + more
        if id(node) in keep:
            done[id(node)] = g
        if node.vjp is None:
            continue
        for p, pg in zip(node.parents, node.vjp(g)):
            if pg is not None:
                parts.setdefault(id(p), []).append((node.n, np.asarray(pg, dtype=p.value.dtype)))
    return [done.get(id(leaf)) for leaf in leaves]
