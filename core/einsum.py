"""The sharded einsum rule: the output layout of an einsum, and what the operands must move first.

Each einsum letter gets one stack of mesh axes that every operand holding that letter shards it
with; a mesh axis serves one letter. A letter summed away turns its axes into pending sums of
the output (``partial``). An operand may stay partial over an axis no letter uses and no other
operand is partial over (the einsum is linear in each operand). When the operands disagree, the
candidates are the stacks each letter already has (and their prefixes); the cheapest set of
redistributions (bytes the busiest device sends) wins, then the one with the least local work. The
pending sums a choice creates count as the reduce-scatter they will cost at least.
"""

from __future__ import annotations

import itertools
import math
import string
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

from .plan import Plan, plan_redistribute
from .spec import Layout, P, normalize_shape
from .steps import Kind, collective_bytes

__all__ = ["EinsumPlan", "plan_einsum", "parse_einsum"]


@dataclass(frozen=True, slots=True)
class EinsumPlan:
    """``operand_plans[i]`` moves operand i to the layout in which each rank can run
    ``equation`` on its local shards; the local results form the ``out`` layout."""

    equation: str
    operand_plans: tuple[Plan, ...]
    out: Layout
    out_shape: tuple[int, ...]

    @property
    def operand_layouts(self) -> tuple[Layout, ...]:
        return tuple(p.dst for p in self.operand_plans)

    @property
    def bytes_per_device(self) -> int:
        """Bytes the operands' redistributions send, summed over operands (each plan's busiest
        device; the operands move one after the other)."""
        return sum(p.bytes_per_device for p in self.operand_plans)

    def __str__(self) -> str:
        lines = [f"einsum {self.equation}"]
        for i, p in enumerate(self.operand_plans):
            moved = "; ".join(str(s) for s in p.steps) or "stays"
            lines.append(f"  operand {i}: {p.src} -> {p.dst}: {moved} ({p.bytes_per_device} B)")
        lines.append(f"  out: {self.out} of shape {self.out_shape}")
        return "\n".join(lines)


def parse_einsum(equation: str, nops: int) -> tuple[list[str], str]:
    """(operand terms, output letters) of a checked einsum equation."""
    if not isinstance(equation, str):
        raise TypeError(f"einsum equation must be a str, got {equation!r}.")
    eq = equation.replace(" ", "")
    if "." in eq:
        raise ValueError(f"einsum {equation!r}: '...' is not supported; name every dim with a letter.")
    lhs, arrow, out = eq.partition("->")
    terms = lhs.split(",")
    for t in terms + [out]:
        bad = [c for c in t if c not in string.ascii_letters]
        if bad:
            raise ValueError(f"einsum {equation!r}: {bad[0]!r} is not a dim letter; use a-z and A-Z.")
    if len(terms) != nops:
        raise ValueError(f"einsum {equation!r} has {len(terms)} operands but {nops} layouts were given.")
    if not arrow:  # numpy's implicit output: letters seen once, sorted
        counts = {c: lhs.count(c) for c in lhs if c != ","}
        out = "".join(sorted(c for c, k in counts.items() if k == 1))
    if len(set(out)) != len(out):
        raise ValueError(f"einsum {equation!r}: output {out!r} repeats a letter.")
    missing = [c for c in out if c not in lhs]
    if missing:
        raise ValueError(f"einsum {equation!r}: output letter {missing[0]!r} appears in no operand.")
    return terms, out


def plan_einsum(equation: str, layouts: Sequence[Layout], shapes: Sequence[Sequence[int]], *,
                itemsize: int = 4) -> EinsumPlan:
    """The cheapest way to run ``numpy.einsum(equation, *operands)`` on operands in ``layouts``."""
    layouts, shapes = tuple(layouts), tuple(normalize_shape(s) for s in shapes)
    for i, l in enumerate(layouts):
        if not isinstance(l, Layout):
            raise TypeError(f"plan_einsum: operand {i}'s layout is {l!r} ({type(l).__name__}), not a parlay.Layout.")
    if len(layouts) != len(shapes):
        raise ValueError(f"plan_einsum: {len(layouts)} layouts but {len(shapes)} shapes; give one shape per operand.")
    _check_operands(equation, layouts, shapes)  # before the cache: it ignores a spec's written length
    return _plan_einsum(equation, layouts, shapes, itemsize)


def _check_operands(equation, layouts, shapes) -> tuple[list[str], str, dict[str, int]]:
    """(terms, output letters, size of each letter) of operands that fit the equation."""
    terms, out = parse_einsum(equation, len(layouts))
    mesh = layouts[0].mesh
    for i, l in enumerate(layouts):
        if l.mesh != mesh:
            raise ValueError(f"plan_einsum: operand {i} is on {l.mesh} but operand 0 on {mesh}; use one mesh.")
    size: dict[str, int] = {}
    for i, (t, shape) in enumerate(zip(terms, shapes)):
        if len(t) != len(shape):
            raise ValueError(f"einsum {equation!r}: operand {i} is {t!r} ({len(t)} dims) but has shape {shape}.")
        layouts[i].check(shape)
        for c, n in zip(t, shape):
            if size.setdefault(c, n) != n:
                raise ValueError(f"einsum {equation!r}: letter {c!r} has size {size[c]} and {n} in different operands.")
    return terms, out, size


@lru_cache(maxsize=1024)
def _plan_einsum(equation, layouts, shapes, itemsize) -> EinsumPlan:
    terms, out, size = _check_operands(equation, layouts, shapes)
    mesh = layouts[0].mesh

    letters = sorted(size, key=lambda c: (equation.index(c), c))
    options: dict[str, list[tuple[str, ...]]] = {}
    for c in letters:
        opts = {()}
        for t, l in zip(terms, layouts):
            for d, tc in enumerate(t):
                if tc == c:
                    stack = l.dim_axes(d)
                    opts.update(stack[:k] for k in range(len(stack) + 1))
        options[c] = sorted(opts, key=lambda s: (-len(s), s))

    # A letter repeated within one operand (a diagonal, 'ii->i') stays unsharded: one axis
    # cannot shard two dims of a tensor.
    repeated = {c for t in terms for c in t if t.count(c) > 1}
    for c in repeated:
        options[c] = [()]
    # The operands' own stacks first: when they already agree, that candidate costs nothing and
    # the rest are cut off as soon as they cost anything.
    for c in letters:
        own = [l.dim_axes(t.index(c)) for t, l in zip(terms, layouts) if c in t]
        options[c].sort(key=lambda s: (s not in own, -len(s), s))

    best = None
    for choice in itertools.product(*(options[c] for c in letters)):
        stacks = dict(zip(letters, choice))
        used = [a for s in choice for a in s]
        if len(used) != len(set(used)):
            continue
        if any(size[c] % mesh.group_size(s) for c, s in stacks.items()):
            continue
        work = math.prod(size[c] // mesh.group_size(stacks[c]) for c in letters)
        # The pending sums this choice creates are paid for later, at least as a reduce-scatter of
        # the output: without that term, moving an operand a little less could leave a sum over
        # more ranks (3D's linear: 1.6x the bytes of gathering both operands and reducing over one axis).
        summed_n = mesh.group_size(tuple(a for c in letters if c not in out for a in stacks[c]))
        out_elems = math.prod(size[c] // mesh.group_size(stacks[c]) for c in out)
        owed = collective_bytes(Kind.REDUCE_SCATTER, summed_n, out_elems, itemsize) if summed_n > 1 else 0
        for kept in _partial_choices(layouts, set(used)):
            plans, total = [], owed
            for i, t in enumerate(terms):
                target = Layout(mesh, P(*(stacks[c] or None for c in t)), kept[i])
                plans.append(plan_redistribute(layouts[i], target, shapes[i], itemsize))
                total += plans[-1].bytes_per_device
                if best is not None and (total, work) >= best[0]:
                    break
            else:
                best = ((total, work), tuple(plans), stacks, kept)
    _, plans, stacks, kept = best
    summed = [a for c in letters if c not in out for a in stacks[c]]
    pending = set(summed) | {a for k in kept for a in k}
    out_layout = Layout(mesh, P(*(stacks[c] or None for c in out)), tuple(a for a in mesh.axis_names if a in pending))
    return EinsumPlan(equation, plans, out_layout, tuple(size[c] for c in out))


def _partial_choices(layouts: Sequence[Layout], used: set[str]):
    """Which pending sums each operand may keep: an axis no letter uses, kept by one operand."""
    axes = sorted({a for l in layouts for a in l.partial if a not in used})
    holders = [[i for i, l in enumerate(layouts) if a in l.partial] for a in axes]
    # Keeping is free and always at least as cheap; the last option (reduce everywhere) is a fallback.
    for pick in itertools.product(*[h + [None] for h in holders]):
        kept = [[] for _ in layouts]
        for a, i in zip(axes, pick):
            if i is not None:
                kept[i].append(a)
        yield tuple(tuple(k) for k in kept)
