"""A device-free mesh: ordered named axes with sizes, ranks numbered row-major."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable, Mapping

__all__ = ["Mesh", "prime_factors", "ring_pairs"]


def prime_factors(n: int) -> tuple[int, ...]:
    """``n``'s prime factors, smallest first (``()`` for 1)."""
    out, p = [], 2
    while p * p <= n:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    if n > 1:
        out.append(n)
    return tuple(out)


def _check_axis_name(name: object, *, where: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"{where}: mesh axis names are strings, got {name!r} ({type(name).__name__}).")
    if not name.isidentifier() or name == "None":
        raise ValueError(
            f"{where}: mesh axis name {name!r} is not an identifier (or is 'None'); axis names are "
            f"letters, digits and underscores (e.g. 'dp', 'tp', 'fsdp'). '.' is reserved for the "
            f"sub-axes a plan may use, such as 'tp.0'."
        )
    return name


@dataclass(frozen=True, slots=True, init=False)
class Mesh:
    """Ordered named axes with sizes, e.g. ``Mesh(dp=2, tp=4)`` or ``Mesh({"dp": 2, "tp": 4})``.

    No devices: rank ``r`` sits at coordinates ``numpy.unravel_index(r, sizes)`` (row-major,
    last axis fastest), as in ``jax.make_mesh`` on CPU and torch ``init_device_mesh``.
    """

    axes: tuple[tuple[str, int], ...]

    def __init__(self, axes: Mapping[str, int] | Iterable[tuple[str, int]] | None = None, /, **sizes: int):
        self._build(axes, sizes, sub_axes=False)

    def _build(self, axes, sizes, *, sub_axes: bool) -> None:
        if axes is not None and sizes:
            raise TypeError("Mesh takes either a mapping of axes or keyword sizes, not both.")
        if axes is not None and not isinstance(axes, (Mapping, list, tuple)):
            raise TypeError(f"Mesh takes a mapping of axis sizes (Mesh({{'dp': 2}})) or keywords (Mesh(dp=2)), got {axes!r}.")
        items = list(axes.items() if isinstance(axes, Mapping) else (axes if axes is not None else sizes.items()))
        seen: set[str] = set()
        checked = []
        for item in items:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise TypeError(f"Mesh axes are (name, size) pairs, got {item!r}.")
            name, size = item
            if sub_axes and isinstance(name, str) and name.partition(".")[2].isdigit():
                pass  # 'tp.0': made by refine() only
            else:
                _check_axis_name(name, where=f"Mesh({dict(items)!r})")
            if name in seen:
                raise ValueError(f"Mesh axis {name!r} is given twice; each axis name appears once.")
            if isinstance(size, bool) or not isinstance(size, numbers.Integral):
                raise TypeError(f"Mesh axis {name!r} has size {size!r}; sizes are positive ints.")
            size = int(size)
            if size < 1:
                raise ValueError(f"Mesh axis {name!r} has size {size}; sizes are positive ints (1 or more).")
            seen.add(name)
            checked.append((name, size))
        if not checked:
            raise ValueError("A mesh needs at least one axis, e.g. Mesh(dp=2).")
        object.__setattr__(self, "axes", tuple(checked))

    # -- shape -------------------------------------------------------------------------------
    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.axes)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(size for _, size in self.axes)

    @property
    def shape(self) -> dict[str, int]:
        return dict(self.axes)

    @property
    def size(self) -> int:
        return math.prod(self.sizes)

    @property
    def ndim(self) -> int:
        return len(self.axes)

    def axis_size(self, name: str) -> int:
        for axis, size in self.axes:
            if axis == name:
                return size
        raise ValueError(f"{name!r} is not an axis of {self}; its axes are {list(self.axis_names)}.")

    def has_axis(self, name: str) -> bool:
        return any(axis == name for axis, _ in self.axes)

    def group_size(self, names: Iterable[str]) -> int:
        return math.prod(self.axis_size(n) for n in names)

    def check_world_size(self, world_size: int) -> None:
        """Raise if this mesh does not cover exactly ``world_size`` ranks."""
        if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral):
            raise TypeError(f"world_size={world_size!r}; it is a number of ranks, an int.")
        if world_size != self.size:
            raise ValueError(
                f"{self} has {self.size} ranks but the world has {world_size}; the product of the "
                f"mesh's axis sizes must equal the number of ranks. Change the sizes or launch "
                f"{self.size} ranks."
            )

    # -- ranks and coordinates -----------------------------------------------------------------
    def coords(self, rank: int) -> dict[str, int]:
        """The coordinates of ``rank``, one per axis."""
        if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or not 0 <= rank < self.size:
            raise ValueError(f"rank {rank!r} is outside {self} (ranks are the ints 0..{self.size - 1}).")
        out = {}
        for name, size in reversed(self.axes):
            rank, out[name] = divmod(rank, size)
        return {name: out[name] for name in self.axis_names}

    def rank(self, coords: Mapping[str, int]) -> int:
        """The rank at ``coords`` (every axis must be given)."""
        if set(coords) != set(self.axis_names):
            raise ValueError(f"coords {dict(coords)} must name every axis of {self} exactly once.")
        rank = 0
        for name, size in self.axes:
            c = coords[name]
            if not 0 <= c < size:
                raise ValueError(f"coordinate {name}={c} is outside axis {name!r} of size {size}.")
            rank = rank * size + c
        return rank

    def coord(self, rank: int, name: str) -> int:
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank!r} is outside {self} (ranks are the ints 0..{self.size - 1}).")
        return _coord_table(self)[rank][name]

    def index_in_group(self, rank: int, names: Iterable[str]) -> int:
        """Position of ``rank`` in its group over ``names`` (first name major)."""
        idx = 0
        coords = _coord_table(self)[rank]
        for n in names:
            idx = idx * self.axis_size(n) + coords[n]
        return idx

    def groups(self, names: Iterable[str] | str) -> tuple[tuple[int, ...], ...]:
        """The groups of ranks that differ only along ``names``.

        Each group lists its ranks in the order of their coordinates over ``names``, the first
        name major: the order a collective over those axes concatenates in. Groups are ordered
        by their smallest rank.
        """
        names = (names,) if isinstance(names, str) else tuple(names)
        for n in names:
            self.axis_size(n)
        if len(set(names)) != len(names):
            raise ValueError(f"groups over {names}: an axis appears twice.")
        buckets: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        for r in range(self.size):
            c = _coord_table(self)[r]
            key = tuple(c[a] for a in self.axis_names if a not in names)
            buckets.setdefault(key, []).append((self.index_in_group(r, names), r))
        groups = [tuple(r for _, r in sorted(members)) for members in buckets.values()]
        return tuple(sorted(groups, key=min))

    # -- sub-axes ----------------------------------------------------------------------------
    def refine(self, factors: Mapping[str, tuple[int, ...]]) -> "Mesh":
        """Split axes into sub-axes: ``refine({"tp": (2, 2)})`` turns tp=4 into tp.0=2, tp.1=2.

        Sub-axes are major to minor, so ranks keep their numbers (row-major order is unchanged).
        """
        axes = []
        for name, size in self.axes:
            parts = tuple(factors.get(name, (size,)))
            if math.prod(parts) != size:
                raise ValueError(f"cannot split axis {name!r} of size {size} into {parts}: the product differs.")
            if len(parts) == 1:
                axes.append((name, size))
            else:
                axes.extend((f"{name}.{i}", p) for i, p in enumerate(parts))
        out = object.__new__(Mesh)
        out._build(axes, {}, sub_axes=True)
        return out

    # -- printing ----------------------------------------------------------------------------
    def __repr__(self) -> str:
        # Sub-axes ('tp.0', 'tp.1') print as the refinement that made them, so repr round-trips.
        whole: dict[str, int] = {}
        parts: dict[str, list[int]] = {}
        for n, s in self.axes:
            base = n.partition(".")[0]
            whole[base] = whole.get(base, 1) * s
            if "." in n:
                parts.setdefault(base, []).append(s)
        text = "Mesh(" + ", ".join(f"{n}={s}" for n, s in whole.items()) + ")"
        if parts:
            text += ".refine({" + ", ".join(f"{b!r}: {tuple(p)!r}" for b, p in parts.items()) + "})"
        return text

    __str__ = __repr__


@lru_cache(maxsize=256)
def _coord_table(mesh: Mesh) -> tuple[dict[str, int], ...]:
    return tuple(mesh.coords(r) for r in range(mesh.size))


def ring_pairs(mesh: Mesh, axes) -> tuple[tuple[int, int], ...]:
    """(source, destination) ranks of one step around every ring over ``axes``: each member of
    a group sends to the next one (in the group's order), the last to the first."""
    return _ring_pairs(mesh, tuple(axes))


@lru_cache(maxsize=256)
def _ring_pairs(mesh: Mesh, axes: tuple[str, ...]) -> tuple[tuple[int, int], ...]:
    out = []
    for group in mesh.groups(axes):
        out += [(r, group[(k + 1) % len(group)]) for k, r in enumerate(group)]
    return tuple(out)
