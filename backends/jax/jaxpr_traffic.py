"""What JAX explicit runs: every collective of a traced step, read from its jaxpr.

JAX explicit records its forward's plan steps as it traces them (``JaxComm``); its backward is
JAX's transpose of them, which no parlay code runs. The jaxpr of ``value_and_grad`` holds both,
before XLA optimizes anything: each ``lax`` collective an equation (``psum``, ``all_gather``,
``psum_scatter``, ``all_to_all``, ``ppermute``, ``pmax``) with its operands' shapes and its mesh
axes. An equation is the backward's when JAX's name stack says it is a transpose
(``transpose(jvp(...))``: the transposed ``shard_map``, with the recomputation of a remat
layer) or names the accumulated gradients' sums (``GRADIENT_SUMS``, after the last microbatch);
one inside a ``scan`` runs its trip count times.

The records are what torch's log writes for the same collective (backends/torch/collectives.py):
rank 0's bytes in whole elements, the axes the mesh's (a prime atom ``tp#1`` of a split axis back
to its axis when all the axis's atoms are there). The jaxpr cannot say which collectives are a
plan's steps and which an op's own sums: every record's source is ``Source.PLAN``.
"""

from __future__ import annotations

import math

import jax
from jax._src.source_info_util import Scope, Transform

from ...core.log import CollectiveLog, Source, sent_bytes
from ...core.steps import Kind
from .mesh import AtomMesh

__all__ = ["jaxpr_traffic", "GRADIENT_SUMS"]

GRADIENT_SUMS = "gradient_sums"  # the name scope of accumulation's sums after the last microbatch: backward

KINDS = {"psum": Kind.ALL_REDUCE, "psum_invariant": Kind.ALL_REDUCE, "pmax": Kind.ALL_REDUCE,
         "all_gather": Kind.ALL_GATHER, "all_gather_invariant": Kind.ALL_GATHER,
         "reduce_scatter": Kind.REDUCE_SCATTER, "psum_scatter": Kind.REDUCE_SCATTER,
         "all_to_all": Kind.ALL_TO_ALL, "ppermute": Kind.PERMUTE}


def jaxpr_traffic(closed: jax.extend.core.ClosedJaxpr, atoms: AtomMesh) -> CollectiveLog:
    """Device 0's collectives in ``closed`` (a traced step of JAX explicit on ``atoms``'s mesh)."""
    log = CollectiveLog()
    _walk(closed.jaxpr, atoms, log, backward=False, times=1)
    return log


def _walk(jaxpr, atoms: AtomMesh, log: CollectiveLog, *, backward: bool, times: int) -> None:
    sizes = dict(atoms.atom_axes)
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        back = backward or _is_backward(eqn.source_info.name_stack)
        if name in KINDS:
            names = eqn.params.get("axes", eqn.params.get("axis_name"))
            names = tuple(names) if isinstance(names, (tuple, list)) else (names,)
            n = math.prod(sizes[a] for a in names)
            if n == 1:  # over a size-1 axis (JAX's variance types ask for it): nothing moves, XLA drops it
                continue
            kind, axes = KINDS[name], _mesh_axes(atoms, names)
            for v in eqn.invars:
                elems, item = math.prod(v.aval.shape), v.aval.dtype.itemsize
                if kind is Kind.PERMUTE:  # rank 0 sends its block if it is a source
                    nbytes = elems * item if any(s == 0 for s, _ in eqn.params["perm"]) else 0
                else:
                    nbytes = sent_bytes(kind, n, elems, item)
                for _ in range(times):
                    log.record(kind, axes, nbytes, back, Source.PLAN, v.aval.dtype)
        if name == "while":
            if any(_holds_collectives(j) for j in _inner(eqn)):
                raise ValueError("jaxpr_traffic: a while loop holds collectives; its trip count is not in the jaxpr "
                                 "(a pipeline's tick loop): count a step without one")
            continue
        if name == "cond":
            branches = []
            for branch in eqn.params["branches"]:
                one = CollectiveLog()
                _walk(branch.jaxpr, atoms, one, backward=back, times=times)
                branches.append(one.entries)
            if any(b != branches[0] for b in branches[1:]):
                raise ValueError("jaxpr_traffic: the branches of a cond run different collectives; which runs is "
                                 "decided at run time")
            log.entries += branches[0]
            continue
        trips = eqn.params["length"] if name == "scan" else 1
        for inner in _inner(eqn):
            _walk(inner, atoms, log, backward=back, times=times * trips)


def _is_backward(name_stack) -> bool:
    """JAX's transpose transform on the name stack, or the accumulated sums' scope (by its entries,
    not its text: a user's function or scope may have "transpose" in its name)."""
    return any((isinstance(e, Transform) and e.name == "transpose") or (isinstance(e, Scope) and e.name == GRADIENT_SUMS)
               for e in getattr(name_stack, "stack", ()))


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
