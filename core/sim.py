"""The simulator: layouts and plans executed on per-rank numpy arrays.

This is the executable specification the backends are tested against: ``scatter`` says what a
layout means, ``simulate`` what each step does.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .einsum import EinsumPlan
from .plan import Plan
from .spec import Layout
from .steps import AllGather, AllReduce, AllToAll, LocalSlice, Permute, ReduceScatter, Step

__all__ = ["scatter", "gather", "simulate", "simulate_step", "step_on_mesh", "simulate_einsum", "resolve_partial"]


def _check_shards(shards: Sequence[np.ndarray], layout: Layout, what: str) -> None:
    if len(shards) != layout.mesh.size:
        raise ValueError(
            f"{what}: got {len(shards)} shards for {layout.mesh} with {layout.mesh.size} ranks; "
            f"pass one array per rank, in rank order."
        )


def scatter(x: np.ndarray, layout: Layout, *, rng: np.random.Generator | int | None = 0) -> list[np.ndarray]:
    """Split the global array ``x`` into per-rank shards of ``layout``.

    For a partial layout the ranks of each pending-sum group hold random addends that sum to
    their block (exactly for integer dtypes; the last addend absorbs the rest). ``rng`` seeds them.
    A layout's replicated axes mean identical values, addends included: groups holding the same
    block get the same addends. (Without that, two operands partial over different axes would
    not multiply to the product of their sums.)
    """
    x = np.asarray(x)
    slices = layout.shard_slices(x.shape)
    shards = [np.array(x[s]) for s in slices]
    if not layout.partial:
        return shards
    if not (np.issubdtype(x.dtype, np.integer) or np.issubdtype(x.dtype, np.floating)):
        raise TypeError(f"scatter: a partial layout splits values into addends, which needs a numeric "
                        f"(integer or floating) array, got dtype {x.dtype}.")
    rng = np.random.default_rng(rng)
    mesh = layout.mesh
    by_block: dict[tuple[int, ...], list[np.ndarray]] = {}
    for group in mesh.groups(layout.partial):
        block_key = tuple(layout.shard_index(group[0], d) for d in range(x.ndim))
        if block_key not in by_block:
            block = shards[group[0]]
            if np.issubdtype(block.dtype, np.integer):
                addends = [rng.integers(-9, 10, size=block.shape).astype(block.dtype) for _ in group[1:]]
            else:
                addends = [rng.standard_normal(block.shape).astype(block.dtype) for _ in group[1:]]
            by_block[block_key] = addends + [block - sum(addends, np.zeros_like(block))]
        for r, part in zip(group, by_block[block_key]):
            shards[r] = part.copy()
    return shards


def resolve_partial(shards: Sequence[np.ndarray], layout: Layout) -> list[np.ndarray]:
    """Sum the pending partials: the shards of ``layout`` without its partial axes."""
    _check_shards(shards, layout, "resolve_partial")
    out = list(shards)
    if layout.partial:
        for group in layout.mesh.groups(layout.partial):
            total = sum((shards[r] for r in group[1:]), shards[group[0]].copy())
            for r in group:
                out[r] = total
    return out


def gather(shards: Sequence[np.ndarray], layout: Layout) -> np.ndarray:
    """Assemble the global array from per-rank shards (summing pending partials).

    Ranks holding the same block must hold the same values (after the sums): a replica that
    differs is an error, not silently dropped.
    """
    _check_shards(shards, layout, "gather")
    shards = resolve_partial(shards, layout)
    local = shards[0].shape
    shape = tuple(n * layout.shard_count(d) for d, n in enumerate(local))
    out = np.empty(shape, dtype=shards[0].dtype)
    first: dict[tuple, int] = {}
    for r, s in enumerate(layout.shard_slices(shape)):
        if shards[r].shape != local:
            raise ValueError(f"gather: rank {r} holds shape {shards[r].shape} but rank 0 holds {local}; shards are even.")
        key = tuple((sl.start, sl.stop) for sl in s)
        if key in first:
            if not np.array_equal(shards[r], shards[first[key]]):
                raise ValueError(
                    f"gather: ranks {first[key]} and {r} hold the same block of {layout} but different "
                    f"values; replicas must agree."
                )
            continue
        first[key] = r
        out[s] = shards[r]
    return out


def simulate_step(step: Step, shards: Sequence[np.ndarray], layout: Layout) -> list[np.ndarray]:
    """Execute one step on per-rank arrays; ``layout`` is the layout before the step."""
    return step_on_mesh(step, shards, layout.mesh)


_STEPS = (AllGather, ReduceScatter, AllReduce, AllToAll, LocalSlice, Permute)


def _check_step(step: Step, shards: Sequence[np.ndarray], mesh) -> None:
    """One clear error for a step that does not fit its per-rank inputs (not numpy's IndexError)."""
    if not isinstance(step, _STEPS):
        raise TypeError(f"simulate_step: {step!r} is not a plan step; steps are "
                        f"{', '.join(t.__name__ for t in _STEPS)} (a Plan's .steps).")
    if len(shards) != mesh.size:
        raise ValueError(f"simulate_step: got {len(shards)} shards for {mesh} with {mesh.size} ranks; pass one "
                         f"array per rank, in rank order.")
    local = np.shape(shards[0])
    for r, x in enumerate(shards):
        if np.shape(x) != local:
            raise ValueError(f"simulate_step: rank {r} holds shape {np.shape(x)} but rank 0 holds {local}; a "
                             f"layout's blocks are even, so every rank holds the same shape.")
    if isinstance(step, Permute):
        bad = [r for pair in step.pairs for r in pair if not 0 <= r < mesh.size]
        if bad:
            raise ValueError(f"simulate_step: {step} names rank {bad[0]}, but {mesh} has ranks 0..{mesh.size - 1}.")
        return
    n = mesh.group_size(step.axes)
    if isinstance(step, AllToAll):
        dims, split = (step.split_dim, step.concat_dim), step.split_dim
    elif isinstance(step, AllReduce):
        dims, split = (), None
    else:
        dims, split = (step.dim,), None if isinstance(step, AllGather) else step.dim
    for d in dims:
        if not 0 <= d < len(local):
            raise ValueError(f"simulate_step: {step} on shards of shape {local}, which have no dim {d}; pass the "
                             f"shards of the layout before this step.")
    if split is not None and local[split] % n:
        raise ValueError(f"simulate_step: {step} splits dim {split} of the shards' shape {local} into {n} pieces; "
                         f"its size is not divisible by {n}; pass the shards of the layout before this step.")


def step_on_mesh(step: Step, shards: Sequence[np.ndarray], mesh) -> list[np.ndarray]:
    """Execute one step on per-rank arrays of ``mesh`` (the plan's mesh: its axes may be sub-axes)."""
    _check_step(step, shards, mesh)
    out = list(shards)
    if isinstance(step, Permute):
        for src, dst in step.pairs:
            out[dst] = shards[src]
        return out
    for group in mesh.groups(step.axes):
        n = len(group)
        if isinstance(step, AllGather):
            full = np.concatenate([shards[r] for r in group], axis=step.dim)
            for r in group:
                out[r] = full
        elif isinstance(step, AllReduce):
            total = sum((shards[r] for r in group[1:]), shards[group[0]].copy())
            for r in group:
                out[r] = total
        elif isinstance(step, ReduceScatter):
            total = sum((shards[r] for r in group[1:]), shards[group[0]].copy())
            for k, r in enumerate(group):
                out[r] = np.split(total, n, axis=step.dim)[k]
        elif isinstance(step, AllToAll):
            pieces = [np.split(shards[r], n, axis=step.split_dim) for r in group]
            for k, r in enumerate(group):
                out[r] = np.concatenate([pieces[src][k] for src in range(n)], axis=step.concat_dim)
        elif isinstance(step, LocalSlice):
            for k, r in enumerate(group):
                out[r] = np.split(shards[r], n, axis=step.dim)[k]
    return out


def simulate(plan: Plan, shards: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Execute ``plan`` on the per-rank shards of ``plan.src``; returns shards of ``plan.dst``."""
    _check_shards(shards, plan.src, "simulate")
    local = plan.src.local_shape(plan.shape)
    for r, s in enumerate(shards):
        if tuple(s.shape) != local:
            raise ValueError(
                f"simulate: rank {r} holds shape {tuple(s.shape)} but {plan.src} of {plan.shape} "
                f"gives local shape {local}."
            )
    out = list(shards)
    for step, before in zip(plan.steps, plan.layouts):
        out = simulate_step(step, out, before)
    return out


def simulate_einsum(plan: EinsumPlan, *operands: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Run an ``EinsumPlan``: move each operand's shards, then ``numpy.einsum`` on every rank."""
    if len(operands) != len(plan.operand_plans):
        raise ValueError(f"simulate_einsum: plan has {len(plan.operand_plans)} operands, got {len(operands)}.")
    moved = [simulate(p, shards) for p, shards in zip(plan.operand_plans, operands)]
    return [np.einsum(plan.equation, *local) for local in zip(*moved)]
