"""What JAX explicit runs: every collective of a traced step, read from its jaxpr.

JAX explicit records its forward's plan steps as it traces them (``JaxComm``); its backward is
JAX's transpose of them, which no parlay code runs. The jaxpr of ``value_and_grad`` holds both,
before XLA optimizes anything: each ``lax`` collective an equation (``psum``, ``all_gather``,
``psum_scatter``, ``all_to_all``, ``ppermute``, ``pmax``) with its operands' shapes and its mesh
axes. An equation is the backward's when JAX's name stack says it is a transpose
(``transpose(jvp(...))``: the transposed ``shard_map``, with the recomputation of a remat
layer) or is in the ``BACKWARD`` scope (accumulation's gradient sums after the last microbatch,
a pipeline's backward pieces and its sends of input gradients); one inside a ``scan`` runs its
trip count times. The loss's mean over a pipeline's ranks (the ``LOSS_MEAN`` scope) is left out,
as the plan leaves it out; a pipeline's point-to-point sends (a ``P2P`` scope) are device 0's
where it sends (``Source.P2P``, as torch logs them), not where it only receives.

A ``cond`` whose branches run different collectives is decided at run time: the caller says
which branch device 0 takes (``choices``: by the name of the scope the ``cond`` was traced in,
one branch, or one per trip of the ``scan`` around it: a pipeline's tick loop, whose table says
what each rank runs each tick).

The records are what torch's log writes for the same collective (backends/torch/collectives.py):
rank 0's bytes in whole elements, the axes the mesh's (a prime atom ``tp#1`` of a split axis back
to its axis when all the axis's atoms are there). The jaxpr cannot say which collectives are a
plan's steps and which an op's own sums: every record's source is ``Source.PLAN``, but a
pipeline's sends' (``Source.P2P``).
"""

from __future__ import annotations

import math
import numbers
from typing import Mapping, Sequence

import jax
from jax._src.source_info_util import Scope, Transform

from ...core.log import CollectiveLog, Source, sent_bytes
from ...core.steps import Kind
from .mesh import AtomMesh

__all__ = ["jaxpr_traffic", "BACKWARD", "LOSS_MEAN", "P2P"]

BACKWARD = "parlay_backward"  # a name scope whose collectives are the backward's
LOSS_MEAN = "parlay_loss_mean"  # the loss's mean over pp: not counted (the plan says so)
P2P = "parlay_p2p"  # the prefix of scopes of point-to-point sends: device 0's records are its sends only

KINDS = {"psum": Kind.ALL_REDUCE, "psum_invariant": Kind.ALL_REDUCE, "pmax": Kind.ALL_REDUCE,
         "all_gather": Kind.ALL_GATHER, "all_gather_invariant": Kind.ALL_GATHER,
         "reduce_scatter": Kind.REDUCE_SCATTER, "psum_scatter": Kind.REDUCE_SCATTER,
         "all_to_all": Kind.ALL_TO_ALL, "ppermute": Kind.PERMUTE}


def jaxpr_traffic(closed: jax.extend.core.ClosedJaxpr, atoms: AtomMesh,
                 choices: Mapping[str, int | Sequence[int]] | None = None) -> CollectiveLog:
    """Device 0's collectives in ``closed`` (a traced step of JAX explicit on ``atoms``'s mesh);
    ``choices``: the branch device 0 takes at each ``cond`` traced in a scope of that name (a
    sequence: one per trip of the ``scan`` that holds it)."""
    log = CollectiveLog()
    walker = _Walker(atoms, dict(choices or {}))
    walker.walk(closed.jaxpr, log, backward=False, times=1, trip=None, p2p=False)
    unused = set(walker.choices) - walker.used
    if unused:
        raise ValueError(f"jaxpr_traffic: no cond was traced in the scope(s) {sorted(unused)} that choices name")
    return log


class _Walker:
    def __init__(self, atoms: AtomMesh, choices: dict):
        self.atoms, self.choices, self.used = atoms, choices, set()
        self.sizes = dict(atoms.atom_axes)

    def walk(self, jaxpr, log: CollectiveLog, *, backward: bool, times: int, trip: int | None, p2p: bool) -> None:
        """``backward``, ``p2p``: what the equations around ``jaxpr`` say (a cond's branch and a scan's
        body start a name stack of their own); ``trip``: of the scan walked trip by trip."""
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            stack = eqn.source_info.name_stack
            if _in_scope(stack, LOSS_MEAN):
                continue
            back, sends = backward or _is_backward(stack), p2p or _p2p(stack)  # (a branch's stack is its own)
            if name in KINDS:
                self._record(eqn, log, back, times, sends)
            elif name == "while":
                if any(_holds_collectives(j) for j in _inner(eqn)):
                    raise ValueError("jaxpr_traffic: a while loop holds collectives; its trip count is not in the "
                                     "jaxpr: count a step without one")
            elif name == "cond":
                self._cond(eqn, log, back, times, trip, sends)
            elif name == "scan" and (per_trip := self._per_trip(eqn)):
                body, length = eqn.params["jaxpr"].jaxpr, eqn.params["length"]
                seen: dict = {}  # the trips that take the same branches log the same
                for t in range(length):
                    key = tuple(self.choices[n][t] for n in per_trip)
                    if key not in seen:
                        seen[key] = CollectiveLog()
                        self.walk(body, seen[key], backward=back, times=1, trip=t, p2p=sends)
                    for _ in range(times):
                        log.entries += seen[key].entries
            else:
                trips = eqn.params["length"] if name == "scan" else 1
                for inner in _inner(eqn):
                    self.walk(inner, log, backward=back, times=times * trips, trip=trip, p2p=sends)

    def _record(self, eqn, log, back: bool, times: int, p2p: bool) -> None:
        names = eqn.params.get("axes", eqn.params.get("axis_name"))
        names = tuple(names) if isinstance(names, (tuple, list)) else (names,)
        n = math.prod(self.sizes[a] for a in names)
        if n == 1:  # over a size-1 axis (JAX's variance types ask for it): nothing moves, XLA drops it
            return
        kind, axes = KINDS[eqn.primitive.name], _mesh_axes(self.atoms, names)
        for v in eqn.invars:
            elems, item = math.prod(v.aval.shape), v.aval.dtype.itemsize
            if kind is Kind.PERMUTE:  # rank 0 sends its block if it is a source
                nbytes = elems * item if any(s == 0 for s, _ in eqn.params["perm"]) else 0
                if p2p and not nbytes:  # a pipeline's send, which device 0 only receives
                    continue
            else:
                nbytes = sent_bytes(kind, n, elems, item)
            for _ in range(times):
                log.record(kind, axes, nbytes, back, Source.P2P if p2p else Source.PLAN, v.aval.dtype)

    def _cond(self, eqn, log, back: bool, times: int, trip: int | None, p2p: bool) -> None:
        branches = eqn.params["branches"]
        scope = next((n for n in self.choices if _in_scope(eqn.source_info.name_stack, n)), None)
        if scope is not None:
            choice = self.choices[scope]
            if not isinstance(choice, numbers.Integral):
                if trip is None:
                    raise ValueError(f"jaxpr_traffic: the choices of scope {scope!r} are per trip, but its cond is "
                                     f"in no scan walked trip by trip")
                choice = choice[trip]
            self.used.add(scope)
            self.walk(branches[choice].jaxpr, log, backward=back, times=times, trip=trip, p2p=p2p)
            return
        logs = []
        for branch in branches:
            one = CollectiveLog()
            self.walk(branch.jaxpr, one, backward=back, times=times, trip=trip, p2p=p2p)
            logs.append(one.entries)
        if any(b != logs[0] for b in logs[1:]):
            raise ValueError("jaxpr_traffic: the branches of a cond run different collectives; which runs is decided "
                             "at run time (say which device 0 takes: choices, by the scope it is traced in)")
        log.entries += logs[0]

    def _per_trip(self, eqn) -> list[str]:
        """The scopes with per-trip choices whose conds this scan's body holds (not in a nested scan)."""
        names = [n for n, c in self.choices.items() if not isinstance(c, numbers.Integral)]
        found: list[str] = []

        def visit(jaxpr):
            for e in jaxpr.eqns:
                if e.primitive.name == "cond":
                    found.extend(n for n in names if n not in found and _in_scope(e.source_info.name_stack, n))
                if e.primitive.name != "scan":
                    for j in _inner(e):
                        visit(j)
        visit(eqn.params["jaxpr"].jaxpr)
        for n in found:
            if len(self.choices[n]) != eqn.params["length"]:
                raise ValueError(f"jaxpr_traffic: scope {n!r} has {len(self.choices[n])} choices for a scan of "
                                 f"{eqn.params['length']} trips")
        return found


def _scopes(name_stack) -> list[str]:
    """The names of the scopes on a name stack (by its entries, not its text)."""
    return [e.name for e in getattr(name_stack, "stack", ()) if isinstance(e, Scope)]


def _p2p(name_stack) -> bool:
    return any(n.startswith(P2P) for n in _scopes(name_stack))


def _in_scope(name_stack, scope: str) -> bool:
    return scope in _scopes(name_stack)


def _is_backward(name_stack) -> bool:
    """JAX's transpose transform on the name stack, or the ``BACKWARD`` scope (by its entries, not
    its text: a user's function or scope may have "transpose" in its name)."""
    return (any(isinstance(e, Transform) and e.name == "transpose" for e in getattr(name_stack, "stack", ()))
            or _in_scope(name_stack, BACKWARD))


def _inner(eqn):
    """The jaxprs an equation calls (a ``shard_map``'s body, a ``jit``'s, a ``scan``'s, ...)."""
    for value in eqn.params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(v, "eqns"):
                yield v
            elif hasattr(getattr(v, "jaxpr", None), "eqns"):
                yield v.jaxpr


def _holds_collectives(jaxpr) -> bool:
    return any(e.primitive.name in KINDS or any(_holds_collectives(j) for j in _inner(e)) for e in jaxpr.eqns)


def _mesh_axes(atoms: AtomMesh, names: tuple[str, ...]) -> tuple[str, ...]:
    """JAX's axis names as the mesh's: an axis all of whose prime atoms are named by its name, a
    part of one by its atoms (``tp#1``); in the order they come."""
    out: list[str] = []
    for name in names:
        base = name.partition("#")[0]
        full = [a for a, _ in atoms.atoms[base]]
        if all(a in names for a in full):
            if base not in out:
                out.append(base)
        else:
            out.append(name)
    return tuple(out)
