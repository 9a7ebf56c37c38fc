"""The activations one device keeps for its backward, counted by tracing its program on shapes.

The sharded executor runs one device's blocks through ``ShapeComm``: each plan step becomes a
local op of the step's output shape (an all-gather a concatenation, a reduce-scatter or a slice
a slice, an all-to-all a split and concatenation, a sum or a permute the identity), so nothing
needs a device or a mesh of them, and any mesh size traces in the same time. ``jax.vjp`` of the
loss, traced with ``make_jaxpr`` on ``ShapeDtypeStruct``s (no FLOP), lists the residuals it would
keep (JAX's ``saved_residuals``): every value the backward reads that is not an argument, with
the remat policy's ``jax.checkpoint`` in place. What an op keeps is thus JAX's choice, the same
in every backend's executor up to how each framework's autodiff saves an op (torch's autograd
makes its own choices: the README gives the measured difference).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax._src.ad_checkpoint import saved_residuals
from jax.extend.core import Literal

from ...core.cost import Written
from ...core.executor import Sharded
from ...core.program import Program
from ...core.remat import remat_loss, run_layers
from ...core.session import input_values, make_executor, scalar_loss, sharded_params
from ...core.log import CollectiveLog, Source, layer_of
from ...core.ops import ELEMENTWISE
from ...core.steps import AllGather, AllReduce, AllToAll, Kind, LocalSlice, Permute, ReduceScatter
from ...core.strategies import Role
from .comm import custom_op
from .ops import KERNEL, JaxLocal
from .remat import jax_checkpoint

__all__ = ["ShapeComm", "TrafficComm", "Scoped", "activation_bytes", "collective_traffic", "trace_step",
           "trace_stage"]


class ShapeComm:
    """The executor's ``Comm`` for one device traced alone: every step keeps its local shapes."""

    def __init__(self, mesh):
        self.mesh, self.local = mesh, JaxLocal()

    def run_step(self, step, x, plan_mesh):
        n = plan_mesh.group_size(step.axes) if getattr(step, "axes", ()) else 1
        if isinstance(step, AllGather):
            return jnp.concatenate([x] * n, axis=step.dim)
        if isinstance(step, (ReduceScatter, LocalSlice)):
            return lax.slice_in_dim(x, 0, x.shape[step.dim] // n, axis=step.dim)
        if isinstance(step, AllToAll):
            piece = lax.slice_in_dim(x, 0, x.shape[step.split_dim] // n, axis=step.split_dim)
            return jnp.concatenate([piece] * n, axis=step.concat_dim)
        return x  # all-reduce, permute: the same shape

    def slice_shared(self, step, x, plan_mesh):
        return self.run_step(step, x, plan_mesh)

    def vary(self, x, axes, *, param=None):
        return x

    def psum(self, x, axes):
        return x

    def pmax(self, x, axes):
        return lax.stop_gradient(x)

    def axis_index(self, axes):
        return jnp.int32(0)

    def all_gather_many(self, xs, dims, axes):
        n = self.mesh.group_size(axes)
        return [jnp.concatenate([x] * n, axis=d) for x, d in zip(xs, dims)]

    def shift(self, x, axes, *, backward=False):
        return x  # the next rank's block: the same shape

    def custom(self, fwd, bwd, *xs):
        return custom_op(fwd, bwd, *xs)

    def check(self, x: Sharded) -> None:
        pass


class TrafficComm(ShapeComm):
    """``ShapeComm`` that also writes down what rank 0 sends, forward and backward, in a
    ``CollectiveLog`` as torch's collectives do (backends/torch/collectives.py): each step's
    backward is its autograd transpose there (an all-gather's a reduce-scatter, a reduce-scatter's
    an all-gather, an all-to-all's the reverse one, an all-reduce's and a local slice's nothing; a
    shared value's slice gathers its gradient; ``vary`` sums its gradient, ``psum`` passes its
    own). The backward records are written when JAX traces the transposes."""

    def __init__(self, mesh, log: CollectiveLog):
        super().__init__(mesh)
        self.log = log
        self.where = ""  # the layer whose parameter was used last (``Scoped``): the records' ``where``
        self.retraced: list[range] = []  # records of a custom op's forward: JAX traces it again under remat

    def _logged(self, fwd, x, forward, backward, param: str = ""):
        """``fwd(x)``, recording ``forward(x)`` now and ``backward(g)`` when its transpose is traced:
        each a list of (kind, axes, bytes, source), both under the layer the forward ran in
        (``param``: the parameter whose gradient the backward sums)."""
        where = self.where

        def note(records, is_backward):
            for kind, axes, nbytes, source in records:
                self.log.record(kind, axes, nbytes, is_backward, source, x.dtype, where, param if is_backward else "")

        @jax.custom_vjp
        def f(x):
            return fwd(x)

        def f_fwd(x):
            return fwd(x), None

        def f_bwd(_, g):
            note(backward(g), True)
            return (jax.linear_transpose(fwd, x)(g)[0],)

        f.defvjp(f_fwd, f_bwd)
        note(forward(x), False)
        return f(x)

    def run_step(self, step, x, plan_mesh):
        shape = super().run_step
        axes = tuple(getattr(step, "axes", ()))
        n = plan_mesh.group_size(axes) if axes else 1
        size = lambda t: math.prod(t.shape) * t.dtype.itemsize
        rec = lambda kind, nbytes: [(kind, axes, nbytes, Source.PLAN)]
        if isinstance(step, AllGather):
            fw, bw = (lambda t: rec(Kind.ALL_GATHER, (n - 1) * size(t))), \
                (lambda g: rec(Kind.REDUCE_SCATTER, (n - 1) * size(g) // n))
        elif isinstance(step, ReduceScatter):
            fw, bw = (lambda t: rec(Kind.REDUCE_SCATTER, (n - 1) * size(t) // n)), \
                (lambda g: rec(Kind.ALL_GATHER, (n - 1) * size(g)))
        elif isinstance(step, AllToAll):
            fw = bw = lambda t: rec(Kind.ALL_TO_ALL, (n - 1) * size(t) // n)
        elif isinstance(step, AllReduce):
            fw, bw = (lambda t: rec(Kind.ALL_REDUCE, 2 * (n - 1) * size(t) // n)), (lambda g: [])
        elif isinstance(step, Permute):  # rank 0 sends if it is a source, and its gradient back if a destination
            sends, gets = any(s == 0 for s, _ in step.pairs), any(d == 0 for _, d in step.pairs)
            fw = lambda t: [(Kind.PERMUTE, (), size(t) if sends else 0, Source.PLAN)]
            bw = lambda g: [(Kind.PERMUTE, (), size(g) if gets else 0, Source.PLAN)]
        else:  # a local slice of a value that varies over its group: nothing either way
            fw = bw = lambda t: []
        return self._logged(lambda t: shape(step, t, plan_mesh), x, fw, bw)

    def slice_shared(self, step, x, plan_mesh):
        n = plan_mesh.group_size(step.axes)
        return self._logged(lambda t: ShapeComm.run_step(self, step, t, plan_mesh), x, lambda t: [],
                            lambda g: [(Kind.ALL_GATHER, tuple(step.axes),
                                        (n - 1) * math.prod(g.shape) * g.dtype.itemsize, Source.PLAN)])

    def vary(self, x, axes, *, param=None):
        n = self.mesh.group_size(tuple(axes))
        return self._logged(lambda t: t, x, lambda t: [], lambda g: [(
            Kind.ALL_REDUCE, tuple(axes), 2 * (n - 1) * math.prod(g.shape) // n * g.dtype.itemsize, Source.OP)],
            param[0] if param else "")

    def psum(self, x, axes):
        n = self.mesh.group_size(tuple(axes))
        return self._logged(lambda t: t, x, lambda t: [(
            Kind.ALL_REDUCE, tuple(axes), 2 * (n - 1) * math.prod(t.shape) // n * t.dtype.itemsize, Source.OP)],
            lambda g: [])

    def pmax(self, x, axes):  # the loss's max: an all-reduce of a sum's bytes, outside autograd
        return lax.stop_gradient(self.psum(lax.stop_gradient(x), axes))

    def all_gather_many(self, xs, dims, axes):
        return [self.run_step(AllGather(tuple(axes), d), x, self.mesh) for x, d in zip(xs, dims)]

    def custom(self, fwd, bwd, *xs):
        """A custom op (ring attention) whose backward's collectives count in the layer its forward
        ran in: JAX traces the backward after the whole forward, when ``where`` names the head.
        Under remat JAX traces the op's forward a second time, the backward's recomputation: those
        records are marked ``again`` (they run in the backward)."""
        where = self.where

        def scoped(res, g):
            outer, self.where = self.where, where
            try:
                return bwd(res, g)
            finally:
                self.where = outer

        traced = []

        def noted(*args):
            start = len(self.log.entries)
            try:
                return fwd(*args)
            finally:  # traced again (remat's recomputation): those records run in the backward
                entries = self.log.entries
                if traced:
                    entries[start:] = [dataclasses.replace(e, again=True) for e in entries[start:]]
                traced.append(range(start, len(entries)))
                self.retraced.append(traced[-1])

        return super().custom(noted, scoped, *xs)

    def shift(self, x, axes, *, backward=False):
        self.log.record(Kind.PERMUTE, tuple(axes), math.prod(x.shape) * x.dtype.itemsize, backward, dtype=x.dtype,
                        where=self.where)
        return x


# The model's ops that keep a tensor for their backward in torch's autograd (a product's operands,
# a norm's input and statistics, an activation's input, attention's outputs, dropout's mask): under
# remat, torch's non-reentrant checkpoint recomputes a layer until the last of these (it stops
# early once every kept tensor is back), so the collectives after it do not run again.
KEEPS = frozenset({"einsum", "mul", "rms_norm", "layer_norm", "softmax", "attention", "rotary", "dropout", "embed",
                   "cross_entropy", *ELEMENTWISE})


class Scoped:
    """The executor, each parameter's use telling ``comm`` which layer the next collectives
    belong to (``layer_of`` its name): a collective after a layer's last parameter and before the
    next layer's first (its residual's constraint) counts in that layer; the loss in the head's.
    An op in ``KEEPS`` writes down the log's length in ``log.kept`` under its layer."""

    def __init__(self, ops, comm: TrafficComm):
        self._ops, self._comm = ops, comm

    def __getattr__(self, name):
        op = getattr(self._ops, name)
        if name not in KEEPS:
            return op
        comm = self._comm

        def keeps(*args, **kwargs):
            out = op(*args, **kwargs)
            comm.log.kept[comm.where] = len(comm.log.entries)
            return out

        return keeps

    def param(self, name, value, dims):
        self._comm.where = layer_of(name)
        return self._ops.param(name, value, dims)


def remat_again(remat, log: CollectiveLog, comm: Callable[[], TrafficComm]) -> Callable | None:
    """``jax_checkpoint(remat)`` that, for each layer it wraps, adds to ``log`` the collectives
    torch runs again when its backward recomputes the layer: the layer's forward records up to its
    last op in ``KEEPS`` (torch's checkpoint stops there), as forward records (torch logs a
    recomputed collective as its forward), those of a custom op's forward left out (JAX traces that
    forward again itself, so they are already in the log twice). ``comm()``: the trace's comm."""
    checkpoint = jax_checkpoint(remat)
    if checkpoint is None:
        return None

    def run(fn, x):
        start = len(log.entries)
        out = checkpoint(fn, x)
        until = max((n for n in log.kept.values() if n > start), default=start)  # the layer's last kept tensor
        again = [e for i, e in enumerate(log.entries[start:until], start)
                 if not e.backward and not any(i in r for r in comm().retraced)]
        log.entries += [dataclasses.replace(e, again=True) for e in again]
        return out

    return run


def collective_traffic(program: Program) -> CollectiveLog:
    """What rank 0 sends in one ``loss_and_grads`` (forward and backward), traced on shapes: the
    records torch's collectives log, for any mesh size, without a device. The optimizer's moves
    (ZeRO's gathers, the clipping norm) are not part of it (core/traffic.py counts them)."""
    return trace_step(program)[0]


def trace_step(program: Program) -> tuple[CollectiveLog, int, Written]:
    """One ``loss_and_grads`` of rank 0 traced on shapes: what it sends (``collective_traffic``),
    the FLOPs of its matrix products and the bytes its other ops write (``_work``)."""
    if program.pipeline is not None:
        raise ValueError(f"collective_traffic: {program.strategy.name!r} runs a pipeline; its traffic is the "
                         f"schedule's (parlay schedule), not one traced step. Count a program without pp.")
    p = program.micro
    params = _blocks(p, Role.PARAMS, {d.name: d for d in p.decls}, lambda d: jnp.float32)
    inputs = _blocks(p, Role.ACTIVATIONS, dict(p.inputs), lambda d: d.dtype.numpy)
    log = CollectiveLog()

    def loss(params, batch):
        sp = sharded_params(p, params)
        comm = TrafficComm(p.mesh, log)
        ops = make_executor(p, comm, sp, coalesce=False)
        loss = remat_loss(p.model, p.remat, Scoped(ops, comm), sp, input_values(p, batch),
                          remat_again(p.remat, log, lambda: comm))
        return scalar_loss(ops, loss)

    jaxpr = jax.make_jaxpr(jax.grad(loss))(params, inputs)
    flops, written, fused = _work(jaxpr.jaxpr)
    return log, flops, Written(written, fused)


def trace_stage(program: Program, stage: int, part: str = "B") -> CollectiveLog:
    """What rank 0 sends in one microbatch's forward and backward of pipeline ``stage``, traced on
    shapes as the torch backend runs a stage (backends/torch/pipeline.py ``TorchStages``): the
    embedding on the first stage, the stage's layers on a fresh executor, the head and the loss
    on the last, the output moved to the residual layout on the others; the backward (``part``
    B) to the stage's parameters and (after the first) to its input, or to the input alone (I) or
    the parameters alone (W), as a zero-bubble schedule splits it: each pass runs the backward's
    collectives on its own paths, so those on both run twice. The point-to-point sends are not in
    it (planning.py adds them from the schedule)."""
    pipe = program.pipeline
    if pipe is None:
        raise ValueError(f"trace_stage: {program.strategy.name!r} runs no pipeline; use trace_step")
    first = stage == 0
    wrt = {"B": (0,) if first else (0, 2), "I": () if first else (2,), "W": (0,)}[part]
    p = program.micro
    names = pipe.params_of_stage[stage]
    decls = {d.name: d for d in p.decls if d.name in names}
    params = _blocks(p, Role.PARAMS, decls, lambda d: jnp.float32)
    inputs = _blocks(p, Role.ACTIVATIONS, dict(p.inputs), lambda d: d.dtype.numpy)
    shape, dims = p.model.residual(p.batch)
    x_layout = p.activation(dims, shape)
    dtype = jnp.dtype(p.precision.compute)
    x = jax.ShapeDtypeStruct(x_layout.local_shape(tuple(shape)), dtype)
    last = stage == pipe.stages - 1
    log = CollectiveLog()
    if not wrt:  # the first stage's input-only pass: it has no input (torch runs nothing)
        return log

    def run(params, batch, x, dy):
        lay = p.layouts[Role.PARAMS]
        sp = {k: Sharded(v, lay[k], decls[k].shape, frozenset(lay[k].spec.axes), k) for k, v in params.items()}
        comm = TrafficComm(p.mesh, log)
        ops = make_executor(p, comm, sp, coalesce=False)
        scoped = Scoped(ops, comm)
        h = p.model.embed(scoped, sp, input_values(p, batch)) if first else \
            Sharded(x, x_layout, tuple(shape), frozenset(x_layout.spec.axes))
        h = run_layers(p.model, p.remat, scoped, sp, pipe.layers_of_stage[stage], h,
                       remat_again(p.remat, log, lambda: comm))
        if last:
            return scalar_loss(ops, p.model.head(scoped, sp, h, input_values(p, batch)))
        return jnp.sum(ops.constrain(h, dims).local * dy)  # the backward seeded with the received gradient

    jax.make_jaxpr(jax.grad(run, argnums=wrt))(params, inputs, x, x)
    return log


def _work(jaxpr, inside: bool = False) -> tuple[int, int, int]:
    """One device's work in a traced step: the FLOPs of its matrix products (2 per multiply-add of
    every ``dot_general``) and the bytes its other ops write (the memory-bound rest), nested
    jaxprs (remat, custom rules, jit) included, the bytes counted two ways (core/cost.py ``Written``):

    - every op writes its outputs (an unfused program);
    - an op that is one kernel on a GPU (``JaxLocal``'s ``kernel.*`` scopes: the norms, attention,
      softmax, activations) writes only the values that leave it: its output and, in the backward,
      its input gradients. What its forward hands its own backward is not counted (a Triton norm
      keeps per-row statistics, flash attention the log-sum-exp: both recompute the rest), nor what
      it computes inside (``inside``: this jaxpr is a kernel's body).

    Known gaps of the second count: a kernel is known by its op's name, so two calls of one op
    in a row (a norm of a norm) pass their value between them uncounted (parlay's GPT has none);
    where JAX adds a residual's gradient inside a norm's scope (at a remat boundary), the norm's
    own input gradient is not counted (0.9% of the count on the tiny GPTs under block remat);
    torch's softmax under bf16 is two kernels (float32, then the cast), counted as one.
    """
    users: dict = {}  # a value -> the kernels that read it (None: an op outside any kernel)
    kernels = [None if inside else _kernel_of(eqn) for eqn in jaxpr.eqns]
    for eqn, k in zip(jaxpr.eqns, kernels):
        for v in eqn.invars:
            if not isinstance(v, Literal):
                users.setdefault(v, set()).add(k)
    for v in jaxpr.outvars:
        if not isinstance(v, Literal):
            users.setdefault(v, set()).add(None)

    def leaving(eqn, k) -> int:  # the bytes of a kernel's outputs that something else reads
        return sum(_nbytes(v) for v in eqn.outvars if users.get(v, set()) - {k})

    flops = written = fused = 0
    for eqn, k in zip(jaxpr.eqns, kernels):
        subs = [v for v in eqn.params.values() if hasattr(v, "eqns") or hasattr(v, "jaxpr")]
        subs += [b for v in eqn.params.values() if isinstance(v, (tuple, list)) for b in v
                 if hasattr(b, "eqns") or hasattr(b, "jaxpr")]
        if subs:
            for sub in subs:
                f, w, u = _work(getattr(sub, "jaxpr", sub), inside or k is not None)
                flops, written, fused = flops + f, written + w, fused + u
            if k is not None:
                fused += leaving(eqn, k)
            continue
        if eqn.primitive.name == "dot_general":
            (lhs_contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            out = eqn.outvars[0].aval.shape
            flops += 2 * math.prod(out) * math.prod(lhs[d] for d in lhs_contract)
        else:
            nbytes = sum(_nbytes(v) for v in eqn.outvars)
            written += nbytes
            fused += 0 if inside else nbytes if k is None else leaving(eqn, k)
    return flops, written, fused


_KERNEL_NAME = re.compile(re.escape(KERNEL) + r"\w+")


def _kernel_of(eqn) -> str | None:
    """The kernel scope (``kernel.<op>``) an equation was traced in, if any: the innermost."""
    names = _KERNEL_NAME.findall(str(eqn.source_info.name_stack))  # "transpose(jvp(kernel.attention))/..."
    return names[-1] if names else None


def _nbytes(v) -> int:
    aval = getattr(v, "aval", None)
    return math.prod(aval.shape) * aval.dtype.itemsize if hasattr(aval, "shape") else 0


def _blocks(program: Program, role: Role, decls, dtype_of):
    lay = program.layouts[role]
    return {k: jax.ShapeDtypeStruct(lay[k].local_shape(d.shape), dtype_of(d)) for k, d in decls.items()}


def _kept(fn, *args) -> int:
    """Bytes of what ``jax.vjp(fn)`` keeps that is not an argument (JAX's own residual list)."""
    return sum(math.prod(a.shape) * a.dtype.itemsize for a, why in saved_residuals(fn, *args)
               if "argument" not in why and "constant" not in why)


def _largest(fn, *args) -> int:
    """The largest value ``fn``'s forward computes (bytes): the biggest output of any equation."""
    best = 0

    def walk(jaxpr):
        nonlocal best
        for eqn in jaxpr.eqns:
            for v in eqn.outvars:
                aval = getattr(v, "aval", None)
                if hasattr(aval, "shape") and hasattr(aval, "dtype"):
                    best = max(best, math.prod(aval.shape) * aval.dtype.itemsize)
            for param in eqn.params.values():
                for sub in param if isinstance(param, (tuple, list)) else (param,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return best


def activation_bytes(program: Program, backend: str = "torch") -> tuple[int, int, str]:
    """(bytes kept for the backward, the largest single value, how they were counted) on one
    device. ``backend`` matters under a pipeline only: torch keeps each in-flight microbatch's
    autograd graph of its stage, JAX (the tick loop and MPMD) only the stage's input, recomputing
    the stage in its backward."""
    p = program.micro  # one microbatch: accumulation and pipelines keep one microbatch's values per step of it
    params = _blocks(p, Role.PARAMS, {d.name: d for d in p.decls}, lambda d: jnp.float32)
    inputs = _blocks(p, Role.ACTIVATIONS, dict(p.inputs), lambda d: d.dtype.numpy)
    checkpoint = jax_checkpoint(p.remat)
    if program.pipeline is None:
        def loss(params, batch):
            sp = sharded_params(p, params)
            ops = make_executor(p, ShapeComm(p.mesh), sp, coalesce=False)
            return scalar_loss(ops, remat_loss(p.model, p.remat, ops, sp, input_values(p, batch), checkpoint))

        kept = _kept(loss, params, inputs)
        if program.microbatches > 1:
            detail = f"one microbatch of {program.microbatches} (accumulation keeps one at a time)"
        else:
            detail = "one step"
        if p.remat.value != "none":
            detail += f"; remat {p.remat.value}: what it is meant to keep (a compiler may keep recomputed values longer)"
        return kept, _largest(loss, params, inputs), detail
    return _pipelined(program, p, params, inputs, checkpoint, recompute=backend.startswith("jax"))


def _pipelined(program: Program, p: Program, params, inputs, checkpoint, recompute: bool) -> tuple[int, int, str]:
    """The schedule's peak of (stage, microbatch) pairs a rank holds, times what each pair keeps:
    its stage's residuals for one microbatch, or (``recompute``) its stage's input, plus one
    stage's residuals while its backward runs; the busiest rank."""
    from ...core.schedule import Costs, simulate_schedule

    pipe, model = program.pipeline, program.model
    per_stage, held, largest = [], [], 0
    nbytes = lambda a: math.prod(a.shape) * a.dtype.itemsize
    for s in range(pipe.stages):
        names = [k for k in params if k in pipe.params_of_stage[s]]
        last = s == pipe.stages - 1

        def stage(sp, x, batch, s=s, last=last):
            comm = ShapeComm(p.mesh)
            sharded = sharded_params(p, {**{k: jnp.zeros(v.shape, v.dtype) for k, v in params.items()}, **sp})
            ops = make_executor(p, comm, sharded, coalesce=False)
            values = input_values(p, batch)
            h = model.embed(ops, sharded, values) if s == 0 else x
            h = run_layers(model, p.remat, ops, sharded, pipe.layers_of_stage[s], h, checkpoint)
            if last:
                return scalar_loss(ops, model.head(ops, sharded, h, values))
            out = h.local
            return jnp.sum(out.astype(jnp.float32))  # a scalar whose vjp keeps what the stage's does

        sp = {k: params[k] for k in names}
        if s == 0:
            fn, args = (lambda sp, batch: stage(sp, None, batch)), (sp, inputs)
            held.append(sum(nbytes(a) for a in inputs.values()))
        else:
            x = _stage_input(p, model, params, inputs, pipe, s)
            fn = lambda sp, xl, batch, x=x: stage(sp, Sharded(xl, x.layout, x.shape, x.varying), batch)
            args = (sp, jax.ShapeDtypeStruct(x.local.shape, x.local.dtype), inputs)
            held.append(nbytes(x.local))
        per_stage.append(_kept(fn, *args))
        largest = max(largest, _largest(fn, *args))
    sim = simulate_schedule(pipe.schedule, Costs())
    sc = pipe.schedule
    worst = 0
    for r in range(sc.ranks):
        mine = [s for s in range(pipe.stages) if sc.rank_of(s) == r]
        if recompute:
            kept = sim.peak_in_flight[r] * max(held[s] for s in mine) + max(per_stage[s] for s in mine)
        else:
            kept = sim.peak_in_flight[r] * max(per_stage[s] for s in mine)
        worst = max(worst, kept)
    each = "its stage's input (JAX recomputes a stage in its backward)" if recompute else "its stage's residuals"
    return worst, largest, (f"{sc.name}: up to {max(sim.peak_in_flight)} (stage, microbatch) pairs held on a rank, "
                            f"each {each}")


def _stage_input(p: Program, model, params, inputs, pipe, s: int):
    """The Sharded value (abstract) that enters stage s: the previous stages run on shapes."""
    holder = {}

    def run(params, batch):
        comm = ShapeComm(p.mesh)
        sharded = sharded_params(p, params)
        ops = make_executor(p, comm, sharded, coalesce=False)
        h = model.embed(ops, sharded, input_values(p, batch))
        for t in range(s):
            h = run_layers(model, p.remat, ops, sharded, pipe.layers_of_stage[t], h, None)
        holder["x"] = h
        return h.local

    out = jax.eval_shape(run, params, inputs)
    h = holder["x"]
    return Sharded(jax.ShapeDtypeStruct(out.shape, out.dtype), h.layout, h.shape, h.varying)
