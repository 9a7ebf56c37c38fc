"""Parallel strategies as rule sets: where parameters live, where they are used, where the
activations at each constraint point live, and where optimizer states and gradients live.

No strategy has code of its own. The collectives (data-parallel gradient all-reduce, FSDP's
gather and reduce-scatter, Megatron's f and g, Ulysses' all-to-alls) follow from these layouts.
Short names combine with ``+`` (``"dp+tp"``, ``"fsdp+tp"``, ``"dp+tp_sp"``).

Mesh axes: ``dp`` (data: dp, zero1, zero2, fsdp), ``tp`` (tensor: tp, tp_sp), ``sp`` (sequence:
ulysses), ``row`` and ``col`` (the two axes of tp2d).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from .mesh import Mesh
from .rules import RuleError, Rules
from .spec import Layout

__all__ = ["Strategy", "STRATEGIES", "get_strategy"]

_CATEGORIES = ("params", "compute", "activations", "optimizer", "grads")


@dataclass(frozen=True)
class Strategy:
    """Rule sets per role. ``compute`` and ``grads`` default to ``params``; ``optimizer`` to
    ``grads``. ``divides`` lists (config field, axis) pairs that must divide for it to apply."""

    name: str
    params: Rules = Rules()
    compute: Rules | None = None
    activations: Rules = Rules()
    optimizer: Rules | None = None
    grads: Rules | None = None
    divides: tuple[tuple[str, str], ...] = ()

    def rules(self, role: str) -> Rules:
        if role == "compute":
            return self.compute if self.compute is not None else self.params
        if role == "grads":
            return self.grads if self.grads is not None else self.params
        if role == "optimizer":
            return self.optimizer if self.optimizer is not None else self.rules("grads")
        return getattr(self, role)

    @property
    def axes(self) -> tuple[str, ...]:
        seen: list[str] = []
        for role in _CATEGORIES:
            seen += [a for a in self.rules(role).axes if a not in seen]
        return tuple(seen)

    def __add__(self, other: "Strategy") -> "Strategy":
        shared = set(self.axes) & set(other.axes)
        if shared:
            raise ValueError(
                f"cannot combine {self.name!r} and {other.name!r}: both use mesh axis "
                f"{sorted(shared)}; combine strategies over different axes (e.g. 'fsdp+tp')."
            )
        return Strategy(
            f"{self.name}+{other.name}",
            **{role: _merge(self.rules(role), other.rules(role)) for role in _CATEGORIES},
            divides=self.divides + other.divides,
        )

    # -- applying -----------------------------------------------------------------------------------
    def check(self, mesh: Mesh, config=None, *, batch: int | None = None) -> None:
        """Raise one error listing every reason this strategy cannot run on ``mesh`` / ``config``."""
        problems = []
        missing = [a for a in self.axes if not mesh.has_axis(a)]
        if missing:
            problems.append(
                f"strategy {self.name!r} needs mesh axes {list(self.axes)} but {mesh} lacks "
                f"{missing}; e.g. --mesh " + ",".join(f"{a}=2" for a in self.axes)
            )
        if config is not None and not missing:
            for field, axis in self.divides:
                n, k = getattr(config, field), mesh.axis_size(axis)
                if n % k:
                    problems.append(f"{field}={n} is not divisible by {axis}={k}, which strategy "
                                    f"{self.name!r} splits it over")
            if batch is not None:
                n = mesh.group_size([a for a in self.rules("activations").candidates_axes("batch")])
                if batch % n:
                    problems.append(f"batch={batch} is not divisible by {n}, the data-parallel ranks of {mesh}")
        if problems:
            raise ValueError(f"strategy {self.name!r} cannot run on {mesh}: " + "; ".join(problems) + ".")

    def layouts(self, role: str, dims: Mapping[str, Sequence[str | None]], mesh: Mesh,
                shapes: Mapping[str, Sequence[int]] | None = None) -> dict[str, Layout]:
        """Layouts of named tensors for ``role`` (``"params"``, ``"compute"``, ...)."""
        try:
            return self.rules(role).resolve_all(dims, mesh, shapes)
        except RuleError as e:
            raise RuleError(f"strategy {self.name!r}, {role}: " + str(e).split("\n")[0], e.problems) from None


def _merge(a: Rules, b: Rules) -> Rules:
    """Both rule sets; where both shard a name, first the two axes together (a major)."""
    joint = []
    for name, axes in a.rules:
        for name2, axes2 in b.rules:
            if name == name2 and axes and axes2:
                joint.append((name, axes + axes2))
    return Rules(joint) + a + b


def _rules(**mapping) -> Rules:
    return Rules(list(mapping.items()))


_TP_NAMES = dict(heads="tp", kv_heads="tp", mlp="tp", vocab="tp")
_TP_DIVIDES = (("heads", "tp"), ("kv_heads", "tp"), ("mlp", "tp"), ("vocab", "tp"))

STRATEGIES: dict[str, Strategy] = {
    "dp": Strategy("dp", activations=_rules(batch="dp")),
    # Optimizer states (zero1), and gradients (zero2), sharded over dp along the embed dim.
    "zero1": Strategy("zero1", activations=_rules(batch="dp"), grads=Rules(), optimizer=_rules(embed="dp"),
                      divides=(("embed", "dp"),)),
    "zero2": Strategy("zero2", activations=_rules(batch="dp"), grads=_rules(embed="dp"),
                      divides=(("embed", "dp"),)),
    # FSDP / ZeRO-3: stored sharded, used replicated (gathered where used).
    "fsdp": Strategy("fsdp", params=_rules(embed="dp"), compute=Rules(), activations=_rules(batch="dp"),
                     divides=(("embed", "dp"),)),
    "tp": Strategy("tp", params=_rules(**_TP_NAMES), activations=_rules(**_TP_NAMES), divides=_TP_DIVIDES),
    # Megatron sequence parallel: the residual stream (norms, dropout) sharded along seq over tp.
    "tp_sp": Strategy("tp_sp", params=_rules(**_TP_NAMES), activations=_rules(seq="tp", **_TP_NAMES),
                      divides=_TP_DIVIDES + (("seq", "tp"),)),
    # Ulysses: seq-sharded everywhere but inside attention, which is head-sharded.
    # Where the sequence is sharded, heads fall back to replicated (the all-to-all moves sp
    # between the two).
    "ulysses": Strategy("ulysses", activations=Rules([("seq", "sp"), ("proj_seq", "sp"), ("heads", "sp"),
                                                      ("kv_heads", "sp"), ("heads", None), ("kv_heads", None)]),
                        divides=(("seq", "sp"), ("heads", "sp"), ("kv_heads", "sp"))),
    # 2D tensor parallel: weights over both axes, activations batch->row and embed->col.
    "tp2d": Strategy("tp2d", params=_rules(embed="row", heads="col", kv_heads="col", mlp="col", vocab="col"),
                     activations=_rules(batch="row", embed="col", heads="col", kv_heads="col", mlp="col", vocab="col"),
                     divides=(("embed", "row"), ("embed", "col"), ("heads", "col"), ("kv_heads", "col"),
                              ("mlp", "col"), ("vocab", "col"))),
}


def get_strategy(name: str | Strategy) -> Strategy:
    """A strategy by short name; ``"a+b"`` combines (e.g. ``"dp+tp"``, ``"fsdp+tp"``)."""
    if isinstance(name, Strategy):
        return name
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"strategy {name!r}: give a name such as {', '.join(STRATEGIES)}, or several joined by '+'.")
    parts = [p.strip() for p in name.split("+")]
    unknown = [p for p in parts if p not in STRATEGIES]
    if unknown:
        raise ValueError(
            f"unknown strategy {unknown[0]!r} in {name!r}; strategies are {', '.join(STRATEGIES)}, "
            f"combined with '+' (e.g. 'dp+tp')."
        )
    out = STRATEGIES[parts[0]]
    for p in parts[1:]:
        out = out + STRATEGIES[p]
    return out
