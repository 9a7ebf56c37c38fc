"""Parallel strategies as rule sets: where parameters live, where they are used, where the
activations at each constraint point live, and where optimizer states and gradients live.

No strategy has code of its own. The collectives (data-parallel gradient all-reduce, FSDP's
gather and reduce-scatter, Megatron's f and g, Ulysses' all-to-alls) follow from these layouts.
Short names combine with ``+`` (``"dp+tp"``, ``"fsdp+tp"``, ``"dp+tp_sp"``).

Mesh axes: ``dp`` (data: dp, zero1, zero2, fsdp), ``tp`` (tensor: tp, tp_sp), ``sp`` (sequence:
ulysses), ``cp`` (context: ring, ring_contiguous), ``row`` and ``col`` (the two axes of tp2d; tp2.5d adds ``dep``), ``x``, ``y``, ``z``
(tp3d's cube), ``pp`` (pipeline: pp). ``NAME@AXES`` puts a
strategy on other axes (``Strategy.on``): ``fsdp@shard``, ``tp2d@x,y``; so two data strategies
combine over two axes, ``dp@replica+fsdp@shard`` being hybrid sharding (HSDP: parameters sharded
within a group, replicated across groups; the batch over both).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from .mesh import Mesh
from .rules import RuleError, Rules
from .spec import Layout

__all__ = ["Role", "Strategy", "STRATEGIES", "get_strategy"]


class Role(enum.Enum):
    """What a rule set places: parameters as stored, parameters where used, activations (inputs
    and constraint points), optimizer states, gradients."""

    PARAMS = "params"
    COMPUTE = "compute"
    ACTIVATIONS = "activations"
    OPTIMIZER = "optimizer"
    GRADS = "grads"


@dataclass(frozen=True)
class Strategy:
    """Rule sets per role (each a ``Rules`` or a list of (logical name, mesh axes) pairs):
    ``params`` (parameters as stored), ``compute`` (parameters where ``ops.param`` hands them to the
    model; default: as stored; ``Rules()`` gathers them whole, FSDP's pattern), ``activations``
    (the inputs and every ``ops.constrain`` point), ``grads`` (default: as ``params``) and
    ``optimizer`` (AdamW's states; default: as ``grads``). ``zigzag``: mesh axes over which the
    sequence is laid out in zigzag order (core/ring.py: a causal ring attention over them does
    the same work on every rank; the explicit lowerings permute the inputs' ``seq`` dim once, and
    positions, causal masks and ``seq``-indexed parameters follow). ``generic``: logical names whose rules may match no tensor of a model (a built-in
    strategy covers the GPT's whole vocabulary, and a model without, say, a vocabulary is fine);
    in a user's strategy every rule must match some tensor (a typo is an error, not a silent
    replication)."""

    name: str
    params: Rules = Rules()
    compute: Rules | None = None
    activations: Rules = Rules()
    optimizer: Rules | None = None
    grads: Rules | None = None
    zigzag: tuple[str, ...] = ()
    generic: frozenset = field(default=frozenset(), compare=False)

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"Strategy name must be a non-empty str, got {self.name!r}.")
        for role in Role:
            value = getattr(self, role.value)
            if value is None and role in (Role.COMPUTE, Role.OPTIMIZER, Role.GRADS):
                continue
            if not isinstance(value, Rules):  # a list of (logical name, axes) pairs, or a mapping
                try:
                    object.__setattr__(self, role.value, Rules(value))
                except TypeError as e:
                    raise TypeError(f"Strategy {self.name!r}, {role.value}: {e} Give Rules([...]) or a list of "
                                    f"(logical name, mesh axes) pairs.") from None
        object.__setattr__(self, "generic", frozenset(self.generic))
        zigzag = (self.zigzag,) if isinstance(self.zigzag, str) else tuple(self.zigzag)
        if not all(isinstance(a, str) and a.isidentifier() for a in zigzag):
            raise TypeError(f"Strategy {self.name!r}: zigzag names mesh axes (identifiers), got {self.zigzag!r}.")
        object.__setattr__(self, "zigzag", zigzag)

    def rules(self, role: Role | str) -> Rules:
        role = Role(role)
        if role is Role.COMPUTE:
            return self.compute if self.compute is not None else self.params
        if role is Role.GRADS:
            return self.grads if self.grads is not None else self.params
        if role is Role.OPTIMIZER:
            return self.optimizer if self.optimizer is not None else self.rules(Role.GRADS)
        return getattr(self, role.value)

    @property
    def axes(self) -> tuple[str, ...]:
        seen: list[str] = []
        for role in Role:
            seen += [a for a in self.rules(role).axes if a not in seen]
        return tuple(seen) + tuple(a for a in self.zigzag if a not in seen)

    @property
    def names(self) -> frozenset:
        """Every logical name some rule maps."""
        return frozenset(n for role in Role for n, _ in self.rules(role).rules)

    def on(self, *axes: str) -> "Strategy":
        """This strategy over ``axes`` in place of its own (``self.axes``, in that order): every rule
        of every role renamed, so ``STRATEGIES["fsdp"].on("shard")`` shards over ``shard``."""
        own = self.axes
        problems = []
        if len(axes) != len(own):
            problems.append(f"{self.name} uses {len(own)} mesh axis(es) {list(own)}; give as many, e.g. "
                            f"{self.name}@{','.join('xyzuvw'[:len(own)])}")
        bad = [a for a in axes if not isinstance(a, str) or not a.isidentifier()]
        if bad:
            problems.append(f"mesh axis names are identifiers; got {bad}")
        if len(set(axes)) != len(axes):
            problems.append(f"{list(axes)} names an axis twice; each of {self.name}'s axes needs its own")
        if problems:
            raise ValueError(f"strategy {self.name}@{','.join(map(str, axes))}: " + "; ".join(problems) + ".")
        mapping = dict(zip(own, axes))
        rename = lambda rules: None if rules is None else Rules(
            [(n, tuple(mapping.get(a, a) for a in ax)) for n, ax in rules.rules], flax_order=rules.flax_order)
        return Strategy(f"{self.name}@{','.join(axes)}", **{role.value: rename(getattr(self, role.value))
                                                             for role in Role}, generic=self.generic,
                        zigzag=tuple(mapping.get(a, a) for a in self.zigzag))

    def __add__(self, other: "Strategy") -> "Strategy":
        shared = set(self.axes) & set(other.axes)
        if shared:
            raise ValueError(
                f"cannot combine {self.name!r} and {other.name!r}: both use mesh axis "
                f"{sorted(shared)}; combine strategies over different axes (e.g. 'fsdp+tp')."
            )
        return Strategy(
            f"{self.name}+{other.name}",
            **{role.value: _merge(self.rules(role), other.rules(role)) for role in Role},
            generic=self.generic | other.generic, zigzag=self.zigzag + other.zigzag,
        )

    def layouts(self, role: Role | str, dims: Mapping[str, Sequence[str | None]], mesh: Mesh,
                shapes: Mapping[str, Sequence[int]] | None = None) -> dict[str, Layout]:
        """Layouts of named tensors for ``role``."""
        role = Role(role)
        try:
            return self.rules(role).resolve_all(dims, mesh, shapes)
        except RuleError as e:
            raise RuleError(f"strategy {self.name!r}, {role.value}: " + str(e).split("\n")[0], e.problems) from None


def _merge(a: Rules, b: Rules) -> Rules:
    """Both rule sets; where both shard a name, first the two axes together (a major).

    Under Flax's order (rule by rule, as ``tp3d``'s activations resolve: ``mlp -> z`` is applied
    before ``batch -> (y, z)`` so that the batch falls back to ``(y, x)`` in the hidden layer),
    where a rule stands decides which dim gets an axis first. So the joint rules of a name go where
    the Flax-ordered set first names it, its own rules keep their places, and the other set's
    rules follow as fallbacks."""
    joints = {}
    for name, axes in a.rules:
        for name2, axes2 in b.rules:
            if name == name2 and axes and axes2:
                joints.setdefault(name, []).append((name, axes + axes2))
    if not (a.flax_order or b.flax_order):
        return Rules([r for rs in joints.values() for r in rs]) + a + b
    ordered, other = (a, b) if a.flax_order else (b, a)
    out, placed = [], set()
    for name, axes in ordered.rules:
        if name not in placed:
            out += joints.get(name, [])
            placed.add(name)
        out.append((name, axes))
    out += [r for name, rs in joints.items() if name not in placed for r in rs]
    return Rules(out + list(other.rules), flax_order=True)


def _rules(**mapping) -> Rules:
    return Rules(list(mapping.items()))


_TP_NAMES = dict(heads="tp", kv_heads="tp", mlp="tp", vocab="tp")


def _builtin(name: str, **roles) -> Strategy:
    """A built-in strategy: a template over parlay's logical vocabulary (``Dim``), so each of its
    rules may match nothing in a model that lacks that name."""
    out = Strategy(name, **roles)
    return Strategy(name, **roles, generic=out.names)


_SEQ_NAMES = dict(seq="cp", proj_seq="cp", attn_seq="cp")
# 2D (SUMMA's layouts): weights [embed over row, heads/mlp/vocab over col], activations [batch over
# row, features over col]. A linear into heads or mlp gathers its input over col and its weight over
# row; one out of them gathers its weight over row and reduce-scatters its output over col.
_TP2D_PARAMS = dict(embed="row", heads="col", kv_heads="col", mlp="col", vocab="col")
_TP2D_FEATURES = dict(embed="col", heads="col", kv_heads="col", mlp="col", vocab="col")


STRATEGIES: dict[str, Strategy] = {
    "dp": _builtin("dp", activations=_rules(batch="dp")),
    # Optimizer states (zero1), and gradients (zero2), sharded over dp along the embed dim.
    "zero1": _builtin("zero1", activations=_rules(batch="dp"), grads=Rules(), optimizer=_rules(embed="dp")),
    "zero2": _builtin("zero2", activations=_rules(batch="dp"), grads=_rules(embed="dp")),
    # FSDP / ZeRO-3: stored sharded, used replicated (gathered where used).
    "fsdp": _builtin("fsdp", params=_rules(embed="dp"), compute=Rules(), activations=_rules(batch="dp")),
    "tp": _builtin("tp", params=_rules(**_TP_NAMES), activations=_rules(**_TP_NAMES)),
    # Megatron sequence parallel: the residual stream (norms, dropout) sharded along seq over tp.
    "tp_sp": _builtin("tp_sp", params=_rules(**_TP_NAMES), activations=_rules(seq="tp", **_TP_NAMES)),
    # Ulysses: seq-sharded everywhere but inside attention, which is head-sharded.
    # Where the sequence is sharded, heads fall back to replicated (the all-to-all moves sp
    # between the two).
    "ulysses": _builtin("ulysses", activations=Rules([("seq", "sp"), ("proj_seq", "sp"), ("heads", "sp"),
                                                      ("kv_heads", "sp"), ("heads", None), ("kv_heads", None)])),
    # Ring attention (context parallel): the sequence split over cp everywhere, attention too (K and
    # V travel around the ring, core/ring.py), laid out in zigzag order so causal work balances.
    "ring": _builtin("ring", activations=_rules(**_SEQ_NAMES), zigzag=("cp",)),
    "ring_contiguous": _builtin("ring_contiguous", activations=_rules(**_SEQ_NAMES)),
    # 2D tensor parallel: weights over both axes, activations batch->row and embed->col.
    # Pipeline: the model's repeated layers over pp (core.pipeline), in the schedule's stages.
    "pp": _builtin("pp", params=_rules(layers="pp")),
    "tp2d": _builtin("tp2d", params=_rules(**_TP2D_PARAMS), activations=_rules(batch="row", **_TP2D_FEATURES)),
    # 2.5D (Tesseract): tp2d on each of dep layers, the batch split over (row, dep); the weights are
    # replicated over dep, so their gradients are summed there. Tesseract orders the batch's blocks
    # (dep, row); that order is only a labelling of blocks (the same bytes), and XLA's SPMD
    # partitioner computes a wrong input gradient for it (tests/jax/test_xla_known_bugs.py).
    "tp2.5d": _builtin("tp2.5d", params=_rules(**_TP2D_PARAMS),
                       activations=_rules(batch=("row", "dep"), **_TP2D_FEATURES)),
    # 3D (Colossal-AI's Linear3D) on a q x q x q cube (x, y, z): the residual stream (batch, embed)
    # is split ((y, z), x), a layer's hidden (batch, mlp or heads) ((y, x), z): each linear gathers
    # its input over the axis of its output's features, its weight over y, and reduce-scatters its
    # output over the axis it contracted, so consecutive linears swap x and z. A weight is stored
    # [in over (its input features' axis, y), out over the other]: the dim-order fallbacks give fc1
    # (embed (x, y), mlp z) and fc2 (mlp (z, y), embed x). The activations resolve in Flax's order
    # (the feature rules first, so the batch takes (y, x) where z is the features'). Colossal-AI's
    # (i, j, l) are (y, z, x) here.
    "tp3d": _builtin("tp3d", params=Rules([(n, a) for n in ("embed", "heads", "kv_heads", "mlp", "vocab")
                                           for a in (("x" if n == "embed" else "z", "y"),
                                                     "x" if n == "embed" else "z")]),
                     activations=Rules([("embed", "x"), ("heads", "z"), ("kv_heads", "z"), ("mlp", "z"),
                                        ("vocab", "z"), ("batch", ("y", "z")), ("batch", ("y", "x"))],
                                       flax_order=True)),
}


def get_strategy(name: str | Strategy) -> Strategy:
    """A strategy by short name; ``"a+b"`` combines (e.g. ``"dp+tp"``, ``"fsdp+tp"``); ``"a@x,y"``
    puts ``a`` on mesh axes ``x, y`` (e.g. ``"dp@replica+fsdp@shard"``)."""
    if isinstance(name, Strategy):
        return name
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"strategy {name!r}: give a name such as {', '.join(STRATEGIES)}, or several joined by '+'.")
    parts = [p.strip() for p in name.split("+")]
    unknown = [p.partition("@")[0].strip() for p in parts if p.partition("@")[0].strip() not in STRATEGIES]
    if unknown:
        import difflib

        close = difflib.get_close_matches(unknown[0], list(STRATEGIES), n=1)
        hint = (f" Did you mean {close[0]!r}?" if close else "") + (
            " Your own strategy is FILE.py:NAME or package.module:NAME." if unknown[0].endswith(".py") else "")
        raise ValueError(
            f"unknown strategy {unknown[0]!r} in {name!r}; strategies are {', '.join(STRATEGIES)}, "
            f"combined with '+' (e.g. 'dp+tp').{hint}"
        )
    out = None
    for p in parts:
        base, at, axes = p.partition("@")
        one = STRATEGIES[base.strip()]
        if at:
            one = one.on(*(a.strip() for a in axes.split(",")))
        out = one if out is None else out + one
    return out
