"""One record of the collectives a run issued, for every backend (tests count them)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .steps import Kind

__all__ = ["Source", "CollectiveRecord", "CollectiveLog", "layer_of", "sent_bytes"]


class Source(enum.Enum):
    PLAN = "plan"  # a step of a redistribution plan
    OP = "op"  # an op's own reduction (norm statistics, the loss), vary's sum, a gradient bucket
    P2P = "p2p"  # a pipeline stage's output or input gradient, sent to the neighbouring pp rank


def sent_bytes(kind: Kind, group_size: int, elems: int, itemsize: int) -> int:
    """What a rank sends in a collective on ``elems`` local elements, as the logs count it: the ring
    formula (core/steps.py's ``collective_cost``) in whole elements, rounded down (torch's log)."""
    n = group_size
    if n == 1 or kind is Kind.LOCAL_SLICE:
        return 0
    if kind is Kind.ALL_GATHER:
        return (n - 1) * elems * itemsize
    if kind in (Kind.REDUCE_SCATTER, Kind.ALL_TO_ALL):
        return (n - 1) * elems // n * itemsize
    if kind is Kind.ALL_REDUCE:
        return 2 * (n - 1) * elems // n * itemsize
    return elems * itemsize  # a permute


def layer_of(param: str) -> str:
    """The layer a parameter belongs to, by its dotted name: a numbered group's first two parts
    (``blocks.3.attn.wq`` -> ``blocks.3``), else the first (``embed.table`` -> ``embed``)."""
    parts = param.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 and parts[1].isdigit() else parts[0]


@dataclass(frozen=True, slots=True)
class CollectiveRecord:
    kind: Kind
    axes: tuple[str, ...]
    nbytes: int  # sent by this rank (torch: measured on the tensors; JAX: the plan's, at trace time)
    backward: bool = False
    source: Source = Source.PLAN
    dtype: str = ""  # what was sent ("float32", "bfloat16", ...; mixed precision's sums must be float32)
    where: str = ""  # the layer it belongs to ("blocks.3", "embed"; traced counts only: ``layer_of``)
    param: str = ""  # the parameter whose gradient it sums (traced counts only: buckets may join these)
    again: bool = False  # run again by remat's recomputation in the backward (traced counts only)


@dataclass
class CollectiveLog:
    entries: list = field(default_factory=list)
    # traced counts only: layer -> the log's length when its last forward op that keeps a tensor for
    # the backward ended (a remat recomputation of the layer re-runs the records before it)
    kept: dict = field(default_factory=dict)

    def record(self, kind: Kind, axes, nbytes: int, backward: bool = False, source: Source | str = Source.PLAN,
               dtype: object = "", where: str = "", param: str = "") -> None:
        name = str(dtype).removeprefix("torch.")
        self.entries.append(CollectiveRecord(kind, tuple(axes), int(nbytes), backward, Source(source), name, where,
                                             param))

    def clear(self) -> None:
        self.entries.clear()

    def counts(self, *, backward: bool | None = None, source: Source | str | None = None) -> dict:
        """(kind, axes) -> how many, local slices left out (they send nothing)."""
        src = None if source is None else Source(source)
        out: dict = {}
        for e in self.entries:
            if e.kind is not Kind.LOCAL_SLICE and (backward is None or e.backward == backward) and src in (None, e.source):
                out[(e.kind, e.axes)] = out.get((e.kind, e.axes), 0) + 1
        return out

    def bytes(self, *, backward: bool, source: Source | str) -> int:
        src = Source(source)
        return sum(e.nbytes for e in self.entries if e.backward == backward and e.source is src)
