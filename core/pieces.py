"""A layout's checkpoint pieces: which blocks a tensor is stored as, and which rank writes each.

Pure layout maths shared by the checkpoint format (``parlay.checkpoint``) and every backend's
session: a tensor is stored in the layout it had, each distinct block once, by the first rank
that holds it, in that rank's file ``rank-NNNNN.safetensors`` under the key ``name@start,...``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .spec import Layout

__all__ = ["Piece", "rank_file", "pieces_of", "owned_blocks", "box"]


@dataclass(frozen=True)
class Piece:
    file: str
    key: str
    start: tuple[int, ...]
    stop: tuple[int, ...]

    def to_json(self) -> dict:
        return {"file": self.file, "key": self.key, "start": list(self.start), "stop": list(self.stop)}


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def piece_key(name: str, start: Sequence[int]) -> str:
    return f"{name}@{','.join(str(a) for a in start)}"


def _owners(layout: Layout, shape: Sequence[int], holders=None) -> dict[tuple, int]:
    """Each distinct block (as (start, stop) per dim) -> the first rank that holds it (of
    ``holders``, where only some ranks hold the tensor: a pipeline stage's parameters)."""
    out: dict = {}
    for r, sl in enumerate(layout.shard_slices(tuple(shape))):
        if holders is None or r in holders:
            out.setdefault(tuple((s.start, s.stop) for s in sl), r)
    return out


def pieces_of(name: str, layout: Layout, shape: Sequence[int], holders=None) -> list[Piece]:
    if layout.partial:
        raise ValueError(f"checkpoint: {name} is in {layout}, a pending sum; store completed values.")
    return [Piece(rank_file(r), piece_key(name, [a for a, _ in block]), tuple(a for a, _ in block),
                  tuple(b for _, b in block))
            for block, r in _owners(layout, shape, holders).items()]


def owned_blocks(name: str, layout: Layout, shape: Sequence[int], rank: int, holders=None) -> list[Piece]:
    """The pieces rank ``rank`` writes (its block, if it is the first holder)."""
    return [p for p in pieces_of(name, layout, shape, holders) if p.file == rank_file(rank)]


def box(index: Sequence[slice], shape: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(start, stop) per dim of a shard's index (slices that may say None)."""
    bounds = [sl.indices(n)[:2] for sl, n in zip(index, shape)]
    return tuple(a for a, _ in bounds), tuple(b for _, b in bounds)
