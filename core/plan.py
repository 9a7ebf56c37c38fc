"""The redistribution planner: the cheapest sequence of collectives from one layout to another.

The search runs over *atoms*: every mesh axis is split into its prime factors (tp=4 becomes
tp.0=2, tp.1=2; ranks keep their numbers, see ``Mesh.refine``). Working on atoms lets a plan
move half of an axis, which XLA also does and which is sometimes much cheaper. A state says,
per tensor dim, which atoms shard it (major to minor) and which atoms are pending sums; moves
are the steps of ``steps.py``. Dijkstra over states, with cost (bytes the busiest device sends,
number of steps, peak local size), finds the cheapest plan. Axes that the chosen plan never
splits are written back as whole axes, so most plans name only the user's axes.

Two limits keep plans sensible and planning fast:
- an axis replicated in both layouts never carries traffic (see ``_Search``);
- at most ``MAX_ATOMS`` atoms in all: on large meshes the axes are split less finely.
"""

from __future__ import annotations

import heapq
import itertools
import math
import numbers
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterator, Sequence

from .mesh import Mesh, prime_factors
from .spec import Layout, P, normalize_shape
from .steps import (
    AllGather, AllReduce, AllToAll, Kind, LocalSlice, Permute, ReduceScatter, Step, collective_bytes,
    collective_cost,
)

__all__ = ["Plan", "plan_redistribute"]


@dataclass(frozen=True, slots=True)
class Plan:
    """A redistribution as data: ``steps`` turn ``src`` into ``dst``.

    ``mesh`` is the mesh the steps name: ``src.mesh``, or a refinement of it with sub-axes
    (``tp.0``) when the plan moves part of an axis. ``layouts`` has one entry more than
    ``steps``: ``layouts[i]`` is the layout before ``steps[i]`` and the last is ``dst`` (all on
    ``mesh``; a plan with no steps has just ``(src,)``). ``step_bytes[i]`` is what each rank
    sends in ``steps[i]``.
    """

    src: Layout
    dst: Layout
    shape: tuple[int, ...]
    itemsize: int
    mesh: Mesh
    steps: tuple[Step, ...]
    layouts: tuple[Layout, ...]
    step_bytes: tuple[tuple[int, ...], ...]

    @property
    def bytes_per_device(self) -> int:
        """Bytes the busiest device sends over the whole plan."""
        if not self.steps:
            return 0
        return max(sum(per_rank) for per_rank in zip(*self.step_bytes))

    def __len__(self) -> int:
        return len(self.steps)

    def __iter__(self) -> Iterator[Step]:
        return iter(self.steps)

    def __str__(self) -> str:
        lines = [f"{self.src} -> {self.dst} on {self.src.mesh}, shape {self.shape}, itemsize {self.itemsize}"]
        if self.mesh != self.src.mesh:
            lines.append(f"  steps use sub-axes of {self.mesh}")
        for step, after, sent in zip(self.steps, self.layouts[1:], self.step_bytes):
            lines.append(f"  {str(step):<40} -> {str(after):<22} sends {max(sent)} B/device")
        if not self.steps:
            lines.append("  (no steps: the layouts hold the same data)")
        lines.append(f"  total: {self.bytes_per_device} bytes sent by the busiest device")
        return "\n".join(lines)


# -- atoms ---------------------------------------------------------------------------------------

# The search is exponential in the number of atoms: 4 plan in a fraction of a second, 6 can take
# several seconds. Larger meshes split their axes less finely (and may miss a split XLA would find).
MAX_ATOMS = 4

@dataclass(frozen=True)
class _Atoms:
    mesh: Mesh
    factors: dict  # axis -> prime factors (major to minor)
    names: dict  # axis -> atom names
    size: dict  # atom -> size
    axis_of: dict  # atom -> axis

    @classmethod
    def of(cls, mesh: Mesh, involved: set[str]) -> "_Atoms":
        """Atoms of the ``involved`` axes: prime factors, coarsened to at most MAX_ATOMS in all."""
        split = {axis: list(prime_factors(n)) for axis, n in mesh.axes if axis in involved}
        while sum(map(len, split.values())) > MAX_ATOMS:
            # Merge the two most minor factors of the most split axis (ties: the later axis).
            axis = max(split, key=lambda a: (len(split[a]), mesh.axis_names.index(a)))
            f = split[axis]
            if len(f) == 1:  # every axis is whole already: nothing left to merge
                break
            f[-2:] = [f[-2] * f[-1]]
        factors, names, size, axis_of = {}, {}, {}, {}
        for axis, n in mesh.axes:
            f = tuple(split.get(axis, (n,)))
            factors[axis] = f
            names[axis] = (axis,) if len(f) == 1 else tuple(f"{axis}.{i}" for i in range(len(f)))
            for a, s in zip(names[axis], f):
                size[a], axis_of[a] = s, axis
        return cls(mesh, factors, names, size, axis_of)

    def expand(self, axes: Sequence[str]) -> tuple[str, ...]:
        return tuple(a for axis in axes for a in self.names[axis])

    def count(self, atoms: Sequence[str]) -> int:
        return math.prod(self.size[a] for a in atoms)


# A state: (per-dim atom stacks, pending-sum atoms).
_State = tuple[tuple[tuple[str, ...], ...], frozenset]


def _state_of(layout: Layout, ndim: int, atoms: _Atoms) -> _State:
    stacks = tuple(atoms.expand(layout.dim_axes(d)) for d in range(ndim))
    return stacks, frozenset(atoms.expand(layout.partial))


class _Search:
    def __init__(self, atoms: _Atoms, shape: tuple[int, ...], itemsize: int, start: _State, goal: _State):
        self.atoms, self.shape, self.itemsize = atoms, shape, itemsize
        self.keep_partial = goal[1]  # pending sums the destination keeps: never reduce them
        # Atoms replicated in both layouts stay out of the plan. Slicing over one and gathering
        # back later would cut the bytes per device (the work spreads over more ranks), but it
        # sends data over links the user did not involve, often the slow inter-node ones.
        involved = {a for s in start[0] + goal[0] for a in s} | start[1] | goal[1]
        self.all_atoms = tuple(a for a in atoms.size if a in involved)
        self.scale = math.prod(atoms.size[a] for a in self.all_atoms)
        self._classes: dict = {}
        self._expanded: set = set()
        self._counts: dict = {}
        self._elems: dict = {}

    def count(self, stack: tuple[str, ...]) -> int:
        if stack not in self._counts:
            self._counts[stack] = self.atoms.count(stack)
        return self._counts[stack]

    def local_elems(self, stacks) -> int:
        if stacks not in self._elems:
            self._elems[stacks] = math.prod(n // self.count(s) for n, s in zip(self.shape, stacks))
        return self._elems[stacks]

    def fits(self, d: int, stack: tuple[str, ...]) -> bool:
        return self.shape[d] % self.count(stack) == 0

    def moves(self, state: _State):
        """Yield (step on atoms, next state, bytes one device sends)."""
        stacks, partial = state
        L = self.local_elems(stacks)
        # Exact costs times self.scale (every group size divides it): integers, fast to add.
        cost = lambda kind, group: int(collective_cost(kind, self.count(group), L, self.itemsize) * self.scale)
        used = {a for s in stacks for a in s} | partial
        replicated = [a for a in self.all_atoms if a not in used]
        reducible = [a for a in self.all_atoms if a in partial and a not in self.keep_partial]
        ndim = len(stacks)

        def with_stack(*changes):
            new = list(stacks)
            for d, s in changes:
                new[d] = s
            return tuple(new)

        # Gathers, reduce-scatters and slices move one atom at a time: over several atoms they
        # send the same bytes as in sequence, and _merge joins the sequence into one step
        # afterwards. All-to-alls and all-reduces over several atoms send fewer bytes than in
        # sequence, so those moves take every group.
        for i, stack in enumerate(stacks):
            if stack:
                yield AllGather(stack[-1:], i), (with_stack((i, stack[:-1])), partial), cost(Kind.ALL_GATHER, stack[-1:])
            for k in range(1, len(stack) + 1):
                group, rest = stack[-k:], stack[:-k]
                for j in range(ndim):
                    if j != i and self.fits(j, stacks[j] + group):
                        yield (AllToAll(group, j, i), (with_stack((i, rest), (j, stacks[j] + group)), partial),
                               cost(Kind.ALL_TO_ALL, group))
        for k in range(1, len(reducible) + 1):
            for group in itertools.combinations(reducible, k):
                yield AllReduce(group), (stacks, partial - set(group)), cost(Kind.ALL_REDUCE, group)
        for a in reducible:
            for j in range(ndim):
                if self.fits(j, stacks[j] + (a,)):
                    yield ReduceScatter((a,), j), (with_stack((j, stacks[j] + (a,))), partial - {a}), cost(Kind.REDUCE_SCATTER, (a,))
        for a in replicated:
            for j in range(ndim):
                if self.fits(j, stacks[j] + (a,)):
                    yield LocalSlice((a,), j), (with_stack((j, stacks[j] + (a,))), partial), 0
        # A permute reaches every state with the same pending sums and the same block counts,
        # each at the same cost. The first state of such a class that the search settles is its
        # cheapest, so only that one needs the class's permute moves.
        key = (tuple(self.count(s) for s in stacks), partial)
        if key not in self._expanded:
            self._expanded.add(key)
            for other in self._same_blocks(key):
                if other != stacks:
                    yield _PERMUTE, (other, partial), L * self.itemsize * self.scale

    def _same_blocks(self, key):
        counts, partial = key
        if key not in self._classes:
            free = [a for a in self.all_atoms if a not in partial]
            out = []

            def fill(d, avail, acc):
                if d == len(counts):
                    out.append(tuple(acc))
                    return
                for stack in _ordered_subsets(avail, include_empty=True):
                    if self.count(stack) == counts[d]:
                        fill(d + 1, [a for a in avail if a not in stack], acc + [stack])

            fill(0, free, [])
            self._classes[key] = tuple(out)
        return self._classes[key]


_PERMUTE = Permute(())  # placeholder in the search; real pairs are computed once the path is known


def _ordered_subsets(items, *, include_empty=False):
    if include_empty:
        yield ()
    for k in range(1, len(items) + 1):
        yield from itertools.permutations(items, k)


def _search(start: _State, goal: _State, search: _Search) -> list[tuple[Step, _State]]:
    peak0 = search.local_elems(start[0])
    best = {start: (0, 0, peak0)}
    prev: dict = {}
    tie = itertools.count()
    heap = [((0, 0, peak0), next(tie), start)]
    while heap:
        cost, _, state = heapq.heappop(heap)
        if best.get(state) != cost:
            continue
        if state == goal:
            path = []
            while state != start:
                step, parent = prev[state]
                path.append((step, state))
                state = parent
            return path[::-1]
        for step, nxt, sent in search.moves(state):
            c = (cost[0] + sent, cost[1] + 1, max(cost[2], search.local_elems(nxt[0])))
            if nxt not in best or c < best[nxt]:
                best[nxt] = c
                prev[nxt] = (step, state)
                heapq.heappush(heap, (c, next(tie), nxt))
    raise AssertionError("no redistribution plan found")  # unreachable: gather-all then slice always works


def _merge(path: list[tuple[Step, _State]]) -> list[tuple[Step, _State]]:
    """Join consecutive gathers (or slices, or reduce-scatters) of one dim into one step."""
    out: list[tuple[Step, _State]] = []
    for step, state in path:
        if out:
            last, _ = out[-1]
            if type(last) is type(step) and isinstance(step, (AllGather, LocalSlice, ReduceScatter)) and last.dim == step.dim:
                # A gather peels atoms off the end of the stack, so the later one is more major.
                axes = step.axes + last.axes if isinstance(step, AllGather) else last.axes + step.axes
                out[-1] = (type(step)(axes, step.dim), state)
                continue
        out.append((step, state))
    return out


# -- writing the plan back on whole axes where possible -------------------------------------------

def _split_axes(path, start: _State, atoms: _Atoms) -> set[str]:
    """Axes whose atoms the plan separates (so the plan must name sub-axes)."""
    split = set()

    def check_seq(seq):
        for axis, names in atoms.names.items():
            if len(names) == 1:
                continue
            pos = [i for i, a in enumerate(seq) if a in names]
            if pos and (len(pos) != len(names) or [seq[i] for i in pos] != list(names)
                        or pos != list(range(pos[0], pos[0] + len(names)))):
                split.add(axis)

    def check_set(s):
        for axis, names in atoms.names.items():
            hit = [a in s for a in names]
            if any(hit) and not all(hit):
                split.add(axis)

    for step, (stacks, partial) in [(None, start)] + list(path):
        for s in stacks:
            check_seq(s)
        check_set(partial)
        if step is not None and not isinstance(step, Permute):
            check_seq(step.axes)
    return split


def _coarsen(names: Sequence[str], atoms: _Atoms, split: set[str]) -> tuple[str, ...]:
    out, i = [], 0
    while i < len(names):
        axis = atoms.axis_of[names[i]]
        if axis in split or len(atoms.names[axis]) == 1:
            out.append(names[i] if axis in split else axis)
            i += 1
        else:
            out.append(axis)
            i += len(atoms.names[axis])
    return tuple(out)


def _permute_pairs(before: Layout, after: Layout, shape) -> tuple[tuple[int, int], ...]:
    """Who sends to whom so that every rank holds its ``after`` block; each rank sends at most once."""
    mesh = before.mesh
    ndim = len(shape)
    # A permute keeps pending sums: a rank receives only from ranks with its partial coordinates.
    partial = [a for a in before.partial if mesh.axis_size(a) > 1]

    def key(layout, r):
        blocks = tuple(layout.shard_index(r, d) for d in range(ndim))
        return blocks, tuple(mesh.coord(r, a) for a in partial)

    holders: dict = {}
    for r in range(mesh.size):
        holders.setdefault(key(before, r), []).append(r)
    needers: dict = {}
    for r in range(mesh.size):
        needers.setdefault(key(after, r), []).append(r)
    pairs = []
    for k, need in needers.items():
        have = holders[k]
        senders = [r for r in have if r not in need]
        receivers = [r for r in need if r not in have]
        pairs.extend(zip(senders, receivers))
    return tuple(sorted(pairs, key=lambda p: p[1]))


def _step_bytes(step: Step, before: Layout, shape, itemsize: int) -> tuple[int, ...]:
    mesh = before.mesh
    elems = math.prod(before.local_shape(shape))
    if isinstance(step, Permute):
        senders = {s for s, _ in step.pairs}
        return tuple(elems * itemsize if r in senders else 0 for r in range(mesh.size))
    sent = collective_bytes(step.kind, mesh.group_size(step.axes), elems, itemsize)
    return (sent,) * mesh.size


# -- the entry point -----------------------------------------------------------------------------

def plan_redistribute(src: Layout, dst: Layout, shape: Sequence[int], itemsize: int = 4) -> Plan:
    """The cheapest plan (bytes the busiest device sends, ring algorithms) from ``src`` to ``dst``."""
    if not isinstance(src, Layout) or not isinstance(dst, Layout):
        raise TypeError(f"plan_redistribute takes two parlay.Layout, got {type(src).__name__} and {type(dst).__name__}.")
    if isinstance(itemsize, bool) or not isinstance(itemsize, numbers.Integral) or itemsize < 1:
        raise ValueError(f"itemsize={itemsize!r}; it is the bytes per element, a positive int (4 for float32).")
    shape = normalize_shape(shape)
    if src.mesh != dst.mesh:
        raise ValueError(
            f"src is on {src.mesh} but dst on {dst.mesh}; a redistribution moves data within one mesh. "
            f"Build both layouts on the same mesh."
        )
    # Checked before the cache: equal layouts share a plan, but a spec's written length (which
    # Layout equality ignores) decides whether it fits the shape.
    src.check(shape)
    dst.check(shape)
    missing = [a for a in dst.partial if a not in src.partial]
    if missing:
        raise ValueError(
            f"cannot redistribute {src} to {dst}: dst is partial over {missing} but src is not; a "
            f"pending sum cannot be made from a complete value. Drop {missing} from dst's partial "
            f"axes (or start from a layout that is partial over them)."
        )
    return _plan(src, dst, shape, int(itemsize))


@lru_cache(maxsize=2048)
def _plan(src: Layout, dst: Layout, shape: tuple[int, ...], itemsize: int) -> Plan:
    """The search, on layouts ``plan_redistribute`` checked."""
    mesh, ndim = src.mesh, len(shape)
    involved = set(src.spec.axes) | set(src.partial) | set(dst.spec.axes) | set(dst.partial)
    atoms = _Atoms.of(mesh, involved)
    start, goal = _state_of(src, ndim, atoms), _state_of(dst, ndim, atoms)
    search = _Search(atoms, shape, itemsize, start, goal)
    path = _merge(_search(start, goal, search)) if start != goal else []

    split = _split_axes(path, start, atoms)
    plan_mesh = mesh.refine({a: atoms.factors[a] for a in split}) if split else mesh

    def to_layout(state: _State) -> Layout:
        stacks, partial = state
        spec = P(*(_coarsen(s, atoms, split) or None for s in stacks))
        part = _coarsen([a for a in atoms.size if a in partial], atoms, split)
        return Layout(plan_mesh, spec, part)

    def on_plan_mesh(layout: Layout) -> Layout:
        if plan_mesh == mesh:
            return layout
        refine = lambda axes: tuple(n for a in axes for n in (atoms.names[a] if a in split else (a,)))
        return Layout(plan_mesh, P(*(refine(layout.dim_axes(d)) or None for d in range(len(layout.spec)))),
                      refine(layout.partial))

    layouts = [on_plan_mesh(src)] + [to_layout(state) for _, state in path]
    if path:
        layouts[-1] = on_plan_mesh(dst)
    steps, step_bytes = [], []
    for i, (step, _) in enumerate(path):
        before, after = layouts[i], layouts[i + 1]
        if isinstance(step, Permute):
            step = Permute(_permute_pairs(before, after, shape))
        elif isinstance(step, AllToAll):
            step = AllToAll(_coarsen(step.axes, atoms, split), step.split_dim, step.concat_dim)
        else:
            step = type(step)(_coarsen(step.axes, atoms, split), *(() if isinstance(step, AllReduce) else (step.dim,)))
        steps.append(step)
        step_bytes.append(_step_bytes(step, before, shape, itemsize))
    return Plan(src, dst, shape, itemsize, plan_mesh, tuple(steps), tuple(layouts), tuple(step_bytes))
