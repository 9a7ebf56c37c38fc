"""Logical-axis rules: layers name tensor dims logically, a strategy maps names to mesh axes.

Ordered like Flax's ``logical_axis_rules``: for each dim, the rules for its logical name are
tried in order and the first whose mesh axes this tensor has not used yet is taken (``None``
means replicated). Flax itself goes rule by rule (each rule to the first unassigned dim of its
name), which differs where a rule listed earlier would win an axis that an earlier dim's rule
takes first; ``Rules(..., flax_order=True)`` resolves that way (rule lists read from Flax and
MaxText do). parlay's built-in combinations rely on the dim order (a joint rule ``heads ->
(tp, sp)`` listed first yields to ``proj_seq -> sp`` on an earlier dim). Unlike Flax, nothing
falls back silently: a dim whose every rule conflicts, or a rule naming an axis the mesh lacks,
is an error that lists every offending tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable, Mapping, Sequence

from .mesh import Mesh
from .spec import Layout, P, check_layout

__all__ = ["Rules", "RuleError"]

LogicalDims = Sequence[str | None]


class RuleError(ValueError):
    """A rule set does not fit a mesh or a set of tensors; ``problems`` lists each failure."""

    def __init__(self, headline: str, problems: Sequence[str]):
        self.headline, self.problems = headline, tuple(problems)
        super().__init__(headline + "\n" + "\n".join(f"  - {p}" for p in self.problems))

    def __reduce__(self):  # pickles (a worker process raises it): the default would call __init__(message)
        return type(self), (self.headline, self.problems)


def _axes_of(value: object, name: str) -> tuple[str, ...]:
    if value is None or value == ():
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, tuple) and value and all(isinstance(a, str) for a in value):
        if len(set(value)) != len(value):
            raise ValueError(f"rule {name!r} -> {value!r} lists a mesh axis twice.")
        return value
    raise TypeError(
        f"rule {name!r} -> {value!r}: a rule maps a logical dim name to None, a mesh axis name, or a "
        f"tuple of axis names."
    )


def _rule_str(axes: tuple[str, ...]) -> str:
    return "None" if not axes else repr(axes[0]) if len(axes) == 1 else repr(axes)


@dataclass(frozen=True, slots=True, init=False)
class Rules:
    """An ordered rule set, e.g. ``Rules([("batch", "dp"), ("mlp", "tp"), ("heads", "tp")])``."""

    rules: tuple[tuple[str, tuple[str, ...]], ...]
    flax_order: bool = False

    def __init__(self, rules: Iterable[tuple[str, object]] | Mapping[str, object] = (), *, flax_order: bool = False):
        """``flax_order``: resolve as Flax does, rule by rule (each rule to the first unassigned dim
        of its name, if its axes are free), rather than dim by dim; the two differ only where a rule
        listed earlier would win an axis a later dim's rule takes first."""
        items = rules.items() if isinstance(rules, Mapping) else rules
        out = []
        for item in items:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                raise TypeError(f"a rule is a (logical name, mesh axes) pair, got {item!r}.")
            out.append((item[0], _axes_of(item[1], item[0])))
        object.__setattr__(self, "rules", tuple(out))
        object.__setattr__(self, "flax_order", bool(flax_order))

    def __add__(self, other: "Rules") -> "Rules":
        """Concatenate: ``self``'s rules are tried first."""
        return Rules(self.rules + other.rules, flax_order=self.flax_order or other.flax_order)

    def candidates(self, name: str | None) -> tuple[tuple[str, ...], ...]:
        return tuple(axes for n, axes in self.rules if n == name) if name is not None else ()

    def candidates_axes(self, name: str) -> tuple[str, ...]:
        """Every mesh axis some rule for ``name`` uses."""
        return tuple(dict.fromkeys(a for axes in self.candidates(name) for a in axes))

    @property
    def axes(self) -> tuple[str, ...]:
        seen: list[str] = []
        for _, axes in self.rules:
            seen += [a for a in axes if a not in seen]
        return tuple(seen)

    # -- resolving ---------------------------------------------------------------------------
    def _resolve(self, tensor: str, dims: LogicalDims, mesh: Mesh) -> tuple[P | None, list[str]]:
        if isinstance(dims, str) or not isinstance(dims, (tuple, list)):
            raise TypeError(
                f"tensor {tensor!r}: logical dims must be a tuple of names (one per dim), got {dims!r}; "
                f"for one dim write ({dims!r},)."
            )
        for d, name in enumerate(dims):
            if name is not None and not isinstance(name, str):
                raise TypeError(f"tensor {tensor!r}: logical dim {d} is {name!r}; logical dims are names or None.")
        if self.flax_order:
            return self._resolve_flax(tensor, dims, mesh)
        problems: list[str] = []
        entries: list[tuple[str, ...]] = []
        used: dict[str, int] = {}
        for d, name in enumerate(dims):
            cands = self.candidates(name)
            if not cands:  # no rule for this name: replicated
                entries.append(())
                continue
            missing = [a for axes in cands for a in axes if not mesh.has_axis(a)]
            if missing:
                problems.append(
                    f"{tensor!r} dim {d} ({name!r}): a rule maps {name!r} to axis {missing[0]!r}, which "
                    f"{mesh} lacks; add the axis to the mesh or drop the rule"
                )
                entries.append(())
                continue
            chosen = next((axes for axes in cands if not any(a in used for a in axes)), None)
            if chosen is None:
                clash = {a: used[a] for axes in cands for a in axes if a in used}
                taken = ", ".join(f"{a!r} by dim {dd} ({dims[dd]!r})" for a, dd in clash.items())
                problems.append(
                    f"{tensor!r} dim {d} ({name!r}): every rule for {name!r} ({', '.join(map(_rule_str, cands))}) "
                    f"uses a mesh axis this tensor already uses ({taken}); an axis may shard one dim. "
                    f"Add a fallback rule ({name!r}, None) or map the names to different axes"
                )
                entries.append(())
                continue
            for a in chosen:
                used[a] = d
            entries.append(chosen)
        return (None if problems else P(*(e or None for e in entries))), problems

    def _resolve_flax(self, tensor: str, dims: LogicalDims, mesh: Mesh) -> tuple[P | None, list[str]]:
        """Flax's order: each rule in turn goes to the first dim of its name still unassigned, if
        none of its axes is taken yet; a dim no rule could take is an error (Flax replicates it)."""
        problems: list[str] = []
        ruled: list[int] = []
        for d, name in enumerate(dims):
            cands = self.candidates(name)
            if not cands:
                continue
            missing = [a for axes in cands for a in axes if not mesh.has_axis(a)]
            if missing:
                problems.append(f"{tensor!r} dim {d} ({name!r}): a rule maps {name!r} to axis {missing[0]!r}, which "
                                f"{mesh} lacks; add the axis to the mesh or drop the rule")
                continue
            ruled.append(d)
        chosen: dict[int, tuple[str, ...]] = {}
        used: dict[str, int] = {}
        for name, axes in self.rules:
            d = next((d for d in ruled if dims[d] == name and d not in chosen), None)
            if d is None or any(a in used for a in axes):
                continue
            chosen[d] = axes
            for a in axes:
                used[a] = d
        for d in (d for d in ruled if d not in chosen):
            name, cands = dims[d], self.candidates(dims[d])
            taken = ", ".join(f"{a!r} by dim {used[a]} ({dims[used[a]]!r})"
                              for a in dict.fromkeys(a for axes in cands for a in axes) if a in used)
            problems.append(
                f"{tensor!r} dim {d} ({name!r}): every rule for {name!r} ({', '.join(map(_rule_str, cands))}) "
                f"uses a mesh axis an earlier rule gave this tensor ({taken}); an axis may shard one dim. "
                f"Add a fallback rule ({name!r}, None) or map the names to different axes")
        return (None if problems else P(*(chosen.get(d) or None for d in range(len(dims))))), problems

    def resolve(self, dims: LogicalDims, mesh: Mesh, *, name: str = "tensor") -> P:
        """The spec of one tensor whose dims are named ``dims``."""
        if isinstance(dims, (tuple, list)) and all(d is None or isinstance(d, str) for d in dims):
            spec = _resolve_ok(self, tuple(dims), mesh)  # executors resolve the same dims every step
            if spec is not None:
                return spec
        spec, problems = self._resolve(name, dims, mesh)
        if problems:
            raise RuleError(f"rules do not fit {mesh} for 1 tensor:", problems)
        return spec

    def layout(self, dims: LogicalDims, mesh: Mesh, *, name: str = "tensor") -> Layout:
        return Layout(mesh, self.resolve(dims, mesh, name=name))

    def resolve_all(self, tensors: Mapping[str, LogicalDims], mesh: Mesh,
                    shapes: Mapping[str, Sequence[int]] | None = None) -> dict[str, Layout]:
        """Layouts for a tree of named tensors; every failure is reported at once."""
        problems: list[str] = []
        out: dict[str, Layout] = {}
        offenders = set()
        for tname, dims in tensors.items():
            spec, probs = self._resolve(tname, dims, mesh)
            if probs:
                problems += probs
                offenders.add(tname)
                continue
            layout = Layout(mesh, spec)
            if shapes is not None and tname in shapes:
                shape = tuple(shapes[tname])
                if len(shape) != len(dims):
                    problems.append(f"{tname!r}: {len(dims)} logical dims {tuple(dims)} but shape {shape}")
                    offenders.add(tname)
                    continue
                try:
                    check_layout(layout, shape)
                except ValueError as e:
                    problems.append(f"{tname!r} {tuple(dims)}: {e}")
                    offenders.add(tname)
                    continue
            out[tname] = layout
        if problems:
            raise RuleError(f"rules do not fit {mesh} for {len(offenders)} tensor(s):", problems)
        return out

    def __repr__(self) -> str:
        body = ", ".join(f"({n!r}, {a[0]!r})" if len(a) == 1 else f"({n!r}, {a or None!r})" for n, a in self.rules)
        return f"Rules([{body}]{', flax_order=True' if self.flax_order else ''})"


@lru_cache(maxsize=4096)
def _resolve_ok(rules: Rules, dims: tuple, mesh: Mesh) -> P | None:
    """The spec when resolving succeeds (it does not depend on the tensor's name), else None."""
    spec, problems = rules._resolve("tensor", dims, mesh)
    return None if problems else spec
