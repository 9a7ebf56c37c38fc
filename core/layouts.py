"""The layouts an op's operands need when each rank computes on its own block.

Backend-neutral decisions of the sharded executor: which dims must be whole on a rank for the
local computation to be the global one, and which layout the result then has. Einsums have their
own rule (``einsum.py``); these are the other ops. Each is a pure function of layouts (and
shapes), tested against slicing the global array.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Mapping, Sequence

from .spec import Layout, P

__all__ = ["vector_layout", "bias_layout", "rotary_layouts", "attention_layout", "embed_layouts",
           "loss_targets_layout", "reduce_layout", "Rearrange", "parse_rearrange", "rearrange_layouts"]


def vector_layout(x: Layout, ndim: int) -> Layout:
    """A (D,) parameter (norm scale, bias) split like ``x``'s last dim, so it applies locally."""
    return Layout(x.mesh, P(x.dim_axes(ndim - 1) or None))


def bias_layout(x: Layout, ndim: int, bias_ndim: int) -> Layout:
    """A parameter over the last ``bias_ndim`` of ``x``'s ``ndim`` dims, split like them, so it
    adds locally. Never partial; where ``x`` holds pending sums the executor adds it on one
    addend only (the ranks at index 0 of ``x``'s partial axes)."""
    return Layout(x.mesh, P(*(x.dim_axes(d) or None for d in range(ndim - bias_ndim, ndim))))


def rotary_layouts(x: Layout) -> tuple[Layout, Layout]:
    """(B, S, H, D) input: head_dim whole (rotation pairs its two halves); the (S, D/2) tables
    split like the sequence."""
    target = x if not x.dim_axes(3) else Layout(x.mesh, P(*(x.dim_axes(d) or None for d in range(3))))
    return target, Layout(x.mesh, P(x.dim_axes(1) or None))


def attention_layout(q: Layout) -> Layout:
    """q, k, v (B, S, H, D): batch, sequence and heads split as q's, head_dim whole. A split
    sequence runs ring attention over its axes (core/ring.py): K and V travel, q stays."""
    return Layout(q.mesh, P(q.dim_axes(0) or None, q.dim_axes(1) or None, q.dim_axes(2) or None))


def embed_layouts(table: Layout, tokens: Layout, ndim: int = 2) -> tuple[Layout, Layout]:
    """(table target, output layout) of a lookup ``table[tokens]`` with ``ndim``-dim tokens.

    The table may not use the tokens' axes (each rank looks up its own tokens). With the
    vocabulary split, each rank adds the rows it holds and zeros elsewhere: the output is partial
    over the vocabulary's axes.
    """
    used = set(tokens.spec.axes)
    keep = lambda axes: tuple(a for a in axes if a not in used) or None
    target = Layout(table.mesh, P(keep(table.dim_axes(0)), keep(table.dim_axes(1))))
    out = Layout(table.mesh, P(*(tokens.dim_axes(d) or None for d in range(ndim)), target.dim_axes(1) or None),
                 target.dim_axes(0))
    return target, out


def loss_targets_layout(logits: Layout, ndim: int = 3) -> Layout:
    """Targets (every dim but the last) split like the ``ndim``-dim logits' leading dims."""
    return Layout(logits.mesh, P(*(logits.dim_axes(d) or None for d in range(ndim - 1))))


def reduce_layout(x: Layout, ndim: int, dim: int) -> Layout:
    """The result of summing ``dim`` away: the other dims keep their axes; the axes that split
    ``dim`` become pending sums (each rank summed its own block)."""
    spec = P(*(x.dim_axes(d) or None for d in range(ndim) if d != dim))
    return Layout(x.mesh, spec, tuple(x.partial) + x.dim_axes(dim))


# -- rearrange (einops patterns) -------------------------------------------------------------------

_TOKEN = re.compile(r"\(|\)|[A-Za-z_][A-Za-z0-9_]*|1|\S")


@dataclass(frozen=True)
class Rearrange:
    """A parsed ``rearrange`` pattern on a given input shape: each side is a tuple of groups (one
    per dim), a group a tuple of names, major to minor (``()`` and ``1`` are empty groups)."""

    pattern: str
    lhs: tuple[tuple[str, ...], ...]
    rhs: tuple[tuple[str, ...], ...]
    sizes: tuple[tuple[str, int], ...]
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]

    def size(self, name: str) -> int:
        return dict(self.sizes)[name]


def _side(text: str, pattern: str) -> tuple[tuple[str, ...], ...]:
    groups, current = [], None
    for tok in _TOKEN.findall(text):
        if tok == "(":
            if current is not None:
                raise ValueError(f"rearrange {pattern!r}: nested parentheses; a group is one level, e.g. (h w).")
            current = []
        elif tok == ")":
            if current is None:
                raise ValueError(f"rearrange {pattern!r}: ')' without '('.")
            groups.append(tuple(current))
            current = None
        elif tok == "1":  # a dim of size 1 (inside a group it changes nothing)
            if current is None:
                groups.append(())
        elif tok[0].isalpha() or tok[0] == "_":
            if current is None:
                groups.append((tok,))
            else:
                current.append(tok)
        elif tok == "." or tok == "...":
            raise ValueError(f"rearrange {pattern!r}: '...' is not supported; name every dim.")
        else:
            raise ValueError(f"rearrange {pattern!r}: {tok!r} is not a dim name; use identifiers, '(', ')' and '1'.")
    if current is not None:
        raise ValueError(f"rearrange {pattern!r}: '(' without ')'.")
    return tuple(groups)


def parse_rearrange(pattern: str, shape: Sequence[int], sizes: Mapping[str, int]) -> Rearrange:
    """Parse and check ``pattern`` for an input of ``shape``; ``sizes`` gives names that a group
    cannot infer (at most one unknown name per input group)."""
    if not isinstance(pattern, str) or pattern.count("->") != 1:
        raise ValueError(f"rearrange {pattern!r}: a pattern is 'input dims -> output dims', e.g. 'b (h w) -> b h w'.")
    left, right = pattern.split("->")
    lhs, rhs = _side(left, pattern), _side(right, pattern)
    shape = tuple(int(n) for n in shape)
    if len(lhs) != len(shape):
        raise ValueError(f"rearrange {pattern!r}: the input side names {len(lhs)} dims but the tensor has shape {shape}.")
    names_l = [n for g in lhs for n in g]
    names_r = [n for g in rhs for n in g]
    for side, names in (("input", names_l), ("output", names_r)):
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"rearrange {pattern!r}: {dup[0]!r} appears twice on the {side} side.")
    if set(names_l) != set(names_r):
        odd = sorted(set(names_l) ^ set(names_r))
        raise ValueError(f"rearrange {pattern!r}: {odd[0]!r} is on one side only; rearrange moves dims, it does not "
                         f"add or reduce them.")
    unknown = sorted(set(sizes) - set(names_l))
    if unknown:
        raise ValueError(f"rearrange {pattern!r}: size given for {unknown[0]!r}, which the pattern does not name.")
    known = {k: int(v) for k, v in sizes.items()}
    for g, n in zip(lhs, shape):
        missing = [a for a in g if a not in known]
        prod = math.prod(known[a] for a in g if a in known)
        if len(missing) > 1:
            raise ValueError(f"rearrange {pattern!r}: group ({' '.join(g)}) of size {n} has {len(missing)} unknown "
                             f"sizes ({', '.join(missing)}); give all but one, e.g. {missing[0]}=...")
        if missing:
            if prod == 0 or n % prod:
                raise ValueError(f"rearrange {pattern!r}: group ({' '.join(g)}) has size {n}, not divisible by {prod}.")
            known[missing[0]] = n // prod
        elif prod != n:
            raise ValueError(f"rearrange {pattern!r}: group ({' '.join(g) or '1'}) has sizes of product {prod} but "
                             f"the dim has size {n}.")
    out_shape = tuple(math.prod(known[a] for a in g) for g in rhs)
    return Rearrange(pattern, lhs, rhs, tuple(sorted(known.items())), shape, out_shape)


def _assign(r: Rearrange, layout: Layout) -> tuple[dict[str, tuple[str, ...]], list[tuple[str, ...]]]:
    """Which names of each input group the dim's axes split (major names first, as a dim split
    over a tuple of axes is split by the first, each piece by the next), and the axes kept per
    input dim: a prefix of its axes for which that assignment is exact."""
    mesh, size = layout.mesh, dict(r.sizes)
    name_axes: dict[str, tuple[str, ...]] = {n: () for g in r.lhs for n in g}
    kept: list[tuple[str, ...]] = []
    for d, g in enumerate(r.lhs):
        axes, keep, i, left = layout.dim_axes(d), [], 0, size[g[0]] if g else 1
        for a in axes:
            while i < len(g) and left == 1:  # this name is split to single indices: the next one
                i += 1
                left = size[g[i]] if i < len(g) else 1
            k = mesh.axis_size(a)
            if i >= len(g) or left % k:
                break
            name_axes[g[i]] += (a,)
            keep.append(a)
            left //= k
        kept.append(tuple(keep))
    return name_axes, kept


def rearrange_layouts(r: Rearrange, layout: Layout) -> tuple[Layout, Layout, dict[str, int]]:
    """(input target, output layout, local size of every name) of a sharded ``rearrange``.

    An output group (b1 .. bm) keeps the axes of its names in order where every name before the
    last sharded one is split to single indices (else a rank's block of the merged dim is not
    contiguous); the axes of the names after the first violation are gathered first. Pending
    sums stay (rearrange is linear)."""
    mesh, size = layout.mesh, dict(r.sizes)
    target = layout
    for _ in range(len(layout.spec.axes) + 1):  # each round drops an axis, or stops
        name_axes, kept = _assign(r, target)
        drop: set[str] = set()
        for g in r.rhs:
            sharded = [j for j, n in enumerate(g) if name_axes[n]]
            if not sharded:
                continue
            for j in range(sharded[-1]):
                if size[g[j]] // mesh.group_size(name_axes[g[j]]) != 1:
                    drop.update(g[j + 1:])
                    break
        spec = []
        for d, g in enumerate(r.lhs):
            axes = list(kept[d])
            for n in g:
                if n in drop and name_axes[n]:
                    # Dropping a name's axes shifts every later axis of this dim: drop them too.
                    axes = axes[:axes.index(name_axes[n][0])] if name_axes[n][0] in axes else axes
            spec.append(tuple(axes) or None)
        new = Layout(mesh, P(*spec), layout.partial)
        if new == target:
            break
        target = new
    name_axes, _ = _assign(r, target)
    out = Layout(mesh, P(*(tuple(a for n in g for a in name_axes[n]) or None for g in r.rhs)), target.partial)
    local = {n: s // mesh.group_size(name_axes[n]) for n, s in size.items()}
    return target, out, local
