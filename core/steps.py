"""The steps of a redistribution plan: small frozen records that backends interpret.

Each collective acts over a group of mesh ``axes`` (first axis major), as ``Mesh.groups`` orders
them. Costs follow ring algorithms and count the bytes one device sends.
"""

from __future__ import annotations

import enum
import math
from fractions import Fraction
from dataclasses import dataclass
from typing import ClassVar, Union

__all__ = [
    "Kind", "AllGather", "ReduceScatter", "AllReduce", "AllToAll", "LocalSlice", "Permute", "Step",
    "collective_bytes", "collective_cost",
]


class Kind(enum.Enum):
    ALL_GATHER = "all-gather"
    REDUCE_SCATTER = "reduce-scatter"
    ALL_REDUCE = "all-reduce"
    ALL_TO_ALL = "all-to-all"
    PERMUTE = "permute"
    LOCAL_SLICE = "local-slice"

    def __str__(self) -> str:
        return self.value


def collective_cost(kind: Kind, group_size: int, in_elems: int, itemsize: int) -> Fraction:
    """Bytes one device sends for a collective on ``in_elems`` local input elements, exactly.

    Ring algorithms: all-gather sends its shard n-1 times; reduce-scatter and all-to-all send
    (n-1)/n of the input; all-reduce is a reduce-scatter plus an all-gather, 2(n-1)/n of the
    input. A permute sends the whole shard once (or nothing). Exact fractions, so that a tiny
    all-reduce is not made to look cheaper in several hops by rounding each one up.
    """
    n = group_size
    if n == 1 or kind is Kind.LOCAL_SLICE:
        return Fraction(0)
    if kind is Kind.ALL_GATHER:
        return Fraction((n - 1) * in_elems * itemsize)
    if kind in (Kind.REDUCE_SCATTER, Kind.ALL_TO_ALL):
        return Fraction((n - 1) * in_elems * itemsize, n)
    if kind is Kind.ALL_REDUCE:
        return Fraction(2 * (n - 1) * in_elems * itemsize, n)
    if kind is Kind.PERMUTE:
        return Fraction(in_elems * itemsize)
    raise AssertionError(kind)


def collective_bytes(kind: Kind, group_size: int, in_elems: int, itemsize: int) -> int:
    """``collective_cost`` rounded up to whole bytes. The benchmark costs XLA's collectives with
    the same function, so the comparison is like for like."""
    return math.ceil(collective_cost(kind, group_size, in_elems, itemsize))


def _axes_str(axes: tuple[str, ...]) -> str:
    return ",".join(axes)


@dataclass(frozen=True, slots=True)
class AllGather:
    """Concatenate along ``dim`` over ``axes``; they must be the minor-most axes sharding ``dim``."""

    axes: tuple[str, ...]
    dim: int
    kind: ClassVar[Kind] = Kind.ALL_GATHER

    def __str__(self) -> str:
        return f"all-gather({_axes_str(self.axes)}) dim {self.dim}"


@dataclass(frozen=True, slots=True)
class ReduceScatter:
    """Sum the pending partial over ``axes`` and keep one slice along ``dim`` (``axes`` then
    shard ``dim`` as its minor-most axes)."""

    axes: tuple[str, ...]
    dim: int
    kind: ClassVar[Kind] = Kind.REDUCE_SCATTER

    def __str__(self) -> str:
        return f"reduce-scatter({_axes_str(self.axes)}) dim {self.dim}"


@dataclass(frozen=True, slots=True)
class AllReduce:
    """Sum the pending partial over ``axes``; every rank gets the sum."""

    axes: tuple[str, ...]
    kind: ClassVar[Kind] = Kind.ALL_REDUCE

    def __str__(self) -> str:
        return f"all-reduce({_axes_str(self.axes)})"


@dataclass(frozen=True, slots=True)
class AllToAll:
    """Split ``split_dim`` into n pieces, send piece k to group member k, concatenate what is
    received along ``concat_dim``: ``axes`` move from sharding ``concat_dim`` (minor-most) to
    sharding ``split_dim`` (appended minor-most)."""

    axes: tuple[str, ...]
    split_dim: int
    concat_dim: int
    kind: ClassVar[Kind] = Kind.ALL_TO_ALL

    def __str__(self) -> str:
        return f"all-to-all({_axes_str(self.axes)}) dim {self.concat_dim} -> dim {self.split_dim}"


@dataclass(frozen=True, slots=True)
class LocalSlice:
    """Keep this rank's piece of ``dim`` over the replicated ``axes``; no communication."""

    axes: tuple[str, ...]
    dim: int
    kind: ClassVar[Kind] = Kind.LOCAL_SLICE

    def __str__(self) -> str:
        return f"local-slice({_axes_str(self.axes)}) dim {self.dim}"


@dataclass(frozen=True, slots=True)
class Permute:
    """Point-to-point moves of whole shards: rank ``dst`` receives rank ``src``'s shard for each
    ``(src, dst)`` in ``pairs``; ranks not named as a destination keep their shard."""

    pairs: tuple[tuple[int, int], ...]
    kind: ClassVar[Kind] = Kind.PERMUTE

    def __str__(self) -> str:
        return "permute(" + " ".join(f"{s}->{d}" for s, d in self.pairs) + ")"


Step = Union[AllGather, ReduceScatter, AllReduce, AllToAll, LocalSlice, Permute]
