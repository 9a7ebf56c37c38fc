"""PartitionSpec (``P``) and ``Layout``: how a global array is split and summed over a mesh."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Iterable, Sequence

from .mesh import Mesh

__all__ = ["P", "Layout", "check_layout", "normalize_shape"]

Entry = None | str | tuple[str, ...]


def _entry_repr(axes: tuple[str, ...]) -> str:
    if not axes:
        return "None"
    if len(axes) == 1:
        return repr(axes[0])
    return "(" + ", ".join(repr(a) for a in axes) + ")"


@dataclass(frozen=True, slots=True, init=False)
class P:
    """One entry per tensor dim: ``None``, a mesh axis, or a tuple of axes (major to minor).

    JAX's meaning: ``P(("dp", "tp"), None)`` splits dim 0 over dp, then each piece over tp.
    Missing trailing entries mean ``None``.
    """

    entries: tuple[tuple[str, ...], ...]

    def __init__(self, *entries: Entry):
        norm: list[tuple[str, ...]] = []
        for i, e in enumerate(entries):
            if e is None:
                norm.append(())
            elif isinstance(e, str):
                norm.append((e,))
            elif isinstance(e, tuple) and all(isinstance(a, str) for a in e):
                norm.append(e)
            else:
                raise TypeError(
                    f"P entry {i} is {e!r} ({type(e).__name__}); an entry is None, a mesh axis name, "
                    f"or a tuple of axis names such as ('dp', 'tp')."
                )
        dims_of: dict[str, list[int]] = {}
        for d, axes in enumerate(norm):
            for a in axes:
                dims_of.setdefault(a, []).append(d)
        for a, dims in dims_of.items():
            if len(dims) > 1:
                text = (
                    f"dims {dims[0]} and {dims[1]}" if len(set(dims)) > 1 else f"dim {dims[0]} twice"
                )
                fix = (
                    f"To shard dim {dims[0]} over several axes write a tuple of distinct axes, "
                    f"e.g. P(('dp', 'tp'), None)."
                )
                raise ValueError(
                    f"spec {_spec_repr(norm)} uses mesh axis {a!r} for {text}; an axis may shard one "
                    f"dim, once. {fix}"
                )
        object.__setattr__(self, "entries", tuple(norm))

    @classmethod
    def parse(cls, text: str) -> "P":
        """Parse ``"dp,tp"``, ``"None,dp"`` or ``"(dp,tp),None"`` (also ``"dp+tp,None"``)."""
        if not isinstance(text, str):
            raise TypeError(f"P.parse takes a str such as 'dp,None', got {text!r}.")
        entries: list[Entry] = []
        depth, token = 0, ""
        parts: list[str] = []
        for ch in text.strip():
            if ch == "(":
                depth += 1
            elif ch == ")":
                depth -= 1
                if depth < 0:
                    raise ValueError(f"spec {text!r}: unbalanced ')'.")
            if ch == "," and depth == 0:
                parts.append(token)
                token = ""
            else:
                token += ch
        if depth:
            raise ValueError(f"spec {text!r}: unbalanced '('.")
        parts.append(token)
        if parts == [""]:
            return cls()
        for part in parts:
            part = part.strip()
            if part.startswith("(") and part.endswith(")"):
                names = [n.strip() for n in part[1:-1].replace("+", ",").split(",") if n.strip()]
            else:
                names = [n.strip() for n in part.split("+")]
            if names in ([], ["None"], ["none"], ["_"]):
                entries.append(None)
                continue
            for n in names:
                base, dot, sub = n.partition(".")
                if not base.isidentifier() or n in ("None", "none") or (dot and not sub.isdigit()):
                    raise ValueError(
                        f"spec {text!r}: {n!r} is not an axis name; write entries like dp, None, "
                        f"(dp,tp) separated by commas."
                    )
            entries.append(names[0] if len(names) == 1 else tuple(names))
        return cls(*entries)

    # -- access ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self):
        return iter(None if not a else a[0] if len(a) == 1 else a for a in self.entries)

    def __getitem__(self, d: int) -> Entry:
        a = self.entries[d]
        return None if not a else a[0] if len(a) == 1 else a

    def dim_axes(self, d: int) -> tuple[str, ...]:
        """The axes sharding dim ``d``, major to minor (``()`` past the last entry)."""
        return self.entries[d] if d < len(self.entries) else ()

    @property
    def axes(self) -> tuple[str, ...]:
        """Every axis the spec uses, in order of appearance."""
        return tuple(a for axes in self.entries for a in axes)

    def __repr__(self) -> str:
        return _spec_repr(self.entries)

    def __str__(self) -> str:
        return "[" + ", ".join(
            "None" if not a else a[0] if len(a) == 1 else "(" + ",".join(a) + ")" for a in self.entries
        ) + "]"


def _spec_repr(entries: Sequence[tuple[str, ...]]) -> str:
    return "P(" + ", ".join(_entry_repr(a) for a in entries) + ")"


@dataclass(frozen=True, slots=True, init=False)
class Layout:
    """A mesh, a spec, and the mesh axes over which per-rank values are pending sums.

    Each mesh axis either shards one dim, is partial, or is replicated. The spec is kept without
    trailing ``None`` entries and ``partial`` in mesh order, so equal layouts compare equal.
    """

    mesh: Mesh
    spec: P
    partial: tuple[str, ...]
    # How many entries the spec was given with (trailing Nones included), for the rank check.
    given_len: int = field(default=0, compare=False, hash=False, repr=False)

    def __init__(self, mesh: Mesh, spec: P | Sequence[Entry] = P(), partial: str | Iterable[str] = ()):
        if not isinstance(mesh, Mesh):
            raise TypeError(f"Layout needs a parlay.Mesh, got {type(mesh).__name__}: {mesh!r}.")
        if not isinstance(spec, P):
            if isinstance(spec, (list, tuple)):
                spec = P(*spec)
            else:
                raise TypeError(f"Layout spec must be a parlay.P (or a tuple of entries), got {spec!r}.")
        if partial is None or not isinstance(partial, (str, tuple, list, frozenset, set)):
            raise TypeError(f"partial={partial!r}; give mesh axis names, e.g. partial='tp' or partial=('dp', 'tp'), or ().")
        part = (partial,) if isinstance(partial, str) else tuple(partial)
        for a in part:
            if not isinstance(a, str):
                raise TypeError(f"partial axes are mesh axis names, got {a!r} in partial={part!r}.")
        unknown = [a for a in spec.axes if not mesh.has_axis(a)]
        if unknown:
            raise ValueError(
                f"spec {spec!r} names axis {unknown[0]!r}, which {mesh} lacks; a spec may only use the "
                f"mesh's axes {list(mesh.axis_names)}. Fix the name or add the axis to the mesh."
            )
        unknown = [a for a in part if not mesh.has_axis(a)]
        if unknown:
            raise ValueError(
                f"partial={part!r} names axis {unknown[0]!r}, which {mesh} lacks; partial axes must be "
                f"among the mesh's axes {list(mesh.axis_names)}."
            )
        if len(set(part)) != len(part):
            raise ValueError(f"partial={part!r} lists an axis twice; list each pending-sum axis once.")
        both = [a for a in part if a in spec.axes]
        if both:
            raise ValueError(
                f"axis {both[0]!r} both shards a dim in {spec!r} and is partial; an axis either shards "
                f"a dim, is partial (pending sum), or is replicated. Reduce the partial sum first "
                f"(a reduce-scatter gives the sharded layout)."
            )
        # Trailing Nones say nothing: strip them, so equal layouts compare equal.
        object.__setattr__(self, "given_len", len(spec.entries))
        entries = list(spec.entries)
        while entries and not entries[-1]:
            entries.pop()
        if len(entries) != len(spec.entries):
            spec = P(*(e or None for e in entries))
        object.__setattr__(self, "mesh", mesh)
        object.__setattr__(self, "spec", spec)
        object.__setattr__(self, "partial", tuple(a for a in mesh.axis_names if a in part))

    # -- axes --------------------------------------------------------------------------------
    def dim_axes(self, d: int) -> tuple[str, ...]:
        return self.spec.dim_axes(d)

    @property
    def replicated_axes(self) -> tuple[str, ...]:
        """Axes that neither shard a dim nor are partial."""
        used = set(self.spec.axes) | set(self.partial)
        return tuple(a for a in self.mesh.axis_names if a not in used)

    @property
    def is_partial(self) -> bool:
        return bool(self.partial)

    def shard_count(self, d: int) -> int:
        """Into how many blocks dim ``d`` is split."""
        return self.mesh.group_size(self.dim_axes(d))

    def replace(self, *, spec: P | Sequence[Entry] | None = None, partial: Iterable[str] | None = None) -> "Layout":
        out = Layout(self.mesh, self.spec if spec is None else spec, self.partial if partial is None else partial)
        if spec is None:
            object.__setattr__(out, "given_len", self.given_len)
        return out

    # -- shapes ------------------------------------------------------------------------------
    def check(self, shape: Sequence[int]) -> tuple[int, ...]:
        """Validate this layout against a global shape; returns the shape as a tuple."""
        return check_layout(self, shape)

    def local_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        shape = self.check(shape)
        return tuple(n // self.shard_count(d) for d, n in enumerate(shape))

    def global_shape(self, local_shape: Sequence[int]) -> tuple[int, ...]:
        """The global shape whose blocks in this layout have ``local_shape``."""
        return tuple(int(n) * self.shard_count(d) for d, n in enumerate(local_shape))

    def shard_index(self, rank: int, d: int) -> int:
        """Which block of dim ``d`` rank ``rank`` holds."""
        return self.mesh.index_in_group(rank, self.dim_axes(d))

    def shard_slices(self, shape: Sequence[int]) -> tuple[tuple[slice, ...], ...]:
        """For each rank in order, the slices of the global array that rank holds."""
        local = self.local_shape(shape)
        return tuple(
            tuple(slice(self.shard_index(r, d) * n, (self.shard_index(r, d) + 1) * n) for d, n in enumerate(local))
            for r in range(self.mesh.size)
        )

    def __repr__(self) -> str:
        extra = f", partial={self.partial!r}" if self.partial else ""
        return f"Layout({self.mesh!r}, {self.spec!r}{extra})"

    def __str__(self) -> str:
        extra = f" partial({','.join(self.partial)})" if self.partial else ""
        return f"{self.spec}{extra}"


def check_layout(layout: Layout, shape: Sequence[int]) -> tuple[int, ...]:
    """The one checker of a layout against a global shape. Lists every problem."""
    shape = normalize_shape(shape)
    if layout.given_len > len(shape):
        raise ValueError(
            f"spec {P(*layout.spec, *([None] * (layout.given_len - len(layout.spec))))!r} has "
            f"{layout.given_len} entries but the tensor of shape {shape} has {len(shape)} dims; give "
            f"at most one entry per dim (drop trailing entries)."
        )
    return _check_layout(layout, shape)


def normalize_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """``shape`` as a tuple of Python ints; checked before any cache (which takes 2.0 for 2)."""
    try:
        given = tuple(shape)
        out = tuple(operator.index(n) for n in given if not isinstance(n, bool))
    except TypeError:
        given, out = shape, None
    if out is None or len(out) != len(given) or any(n < 0 for n in out):
        raise TypeError(f"shape {given!r} must be a tuple of non-negative ints.")
    return out


@lru_cache(maxsize=4096)
def _check_layout(layout: Layout, shape: tuple[int, ...]) -> tuple[int, ...]:
    spec = layout.spec
    problems = []
    if len(spec) > len(shape):
        problems.append(
            f"spec {spec!r} has {len(spec)} entries but the tensor of shape {shape} has {len(shape)} "
            f"dims; give at most one entry per dim (drop trailing entries)"
        )
    for d, n in enumerate(shape):
        axes = spec.dim_axes(d)
        k = layout.mesh.group_size(axes)
        if n % k:
            sizes = " x ".join(f"{a}={layout.mesh.axis_size(a)}" for a in axes)
            problems.append(
                f"dim {d} of shape {shape} has size {n}, not divisible by {k} ({sizes}) in spec {spec!r} "
                f"on {layout.mesh}; shards are even: pad dim {d} to a multiple of {k} or shard it over "
                f"fewer axes"
            )
    if problems:
        raise ValueError("; ".join(problems) + ".")
    return shape
