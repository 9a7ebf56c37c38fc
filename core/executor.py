"""The sharded executor, written once: the neutral ops on per-rank blocks, for every backend.

Each value is a ``Sharded``: this rank's block, its ``Layout``, its global shape, and the mesh
axes it *varies* over. Every op asks the core what its operands must look like (``plan_einsum``,
``plan_redistribute``, the rules in ``layouts.py``), runs those plans through the backend's
``Comm``, and computes on its blocks with the backend's ``LocalOps``.

The variance rule lives here and only here. A value varies over an axis when ranks
along it may hold different values; its gradient there is then a per-rank contribution, summed
where the value stops varying. A value invariant over an axis that meets a value varying over it
goes through ``comm.vary`` (identity forward, a sum of the gradient backward). That one rule is
where data-parallel gradient sums, Megatron's f operator and FSDP's reduce-scatter come from.
Plan steps keep it too: a local slice of a value that is the same on every member of its group
(replicated) first varies it, so the slice's transpose only pads with zeros and the sum happens
once, in ``vary``'s backward (fused into one all-gather where the slice covers the shared axes); an all-reduce makes a value invariant over its axes; a point-to-point
permute moves a block to ranks that differ on every axis, so the value varies over all of them.

A backend provides ``Comm`` (run a plan step with autograd, vary, psum, pmax, axis index) and
``LocalOps`` (its array math); torch, JAX shard_map and the numpy simulator each do.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np

from .einsum import plan_einsum
from .layouts import (attention_layout, bias_layout, embed_layouts, loss_targets_layout, parse_rearrange,
                      rearrange_layouts, reduce_layout, rotary_layouts, vector_layout)
from .mesh import Mesh
from .ops import ELEMENTWISE, DropoutKey, LocalOps, LogicalDims, dropout_keep
from .plan import Plan, plan_redistribute
from .ring import Ring, SeqOrder, ring_backward, ring_forward
from .spec import Layout, P
from .steps import AllGather, AllReduce, AllToAll, LocalSlice, Permute, Step

__all__ = ["Sharded", "Comm", "Hooks", "Fault", "ShardedOps", "param_groups", "group_members"]


@dataclass(frozen=True)
class Sharded:
    """This rank's block ``local`` of a global array of ``shape`` in ``layout``, varying over
    ``varying`` (which includes every axis of the layout: its dims' and its pending sums').
    ``name``: set on a parameter as stored (its gradient may go to a bucket)."""

    local: Any
    layout: Layout
    shape: tuple[int, ...]
    varying: frozenset = frozenset()
    name: str | None = None

    @property
    def ndim(self) -> int:
        return len(self.shape)


class Comm(Protocol):
    """What a backend does between ranks, for the executor. Every method is differentiable where
    the backend differentiates, with these transposes (a varying value's gradient is a per-rank
    contribution; an invariant value's is the same on every rank):
    all-gather <-> reduce-scatter, all-to-all <-> the reverse all-to-all, all-reduce -> identity,
    local slice -> zero padding, permute -> the reverse permute; ``vary`` -> a sum over its axes;
    ``psum`` -> identity; ``pmax`` has no gradient."""

    mesh: Mesh
    local: LocalOps

    def run_step(self, step: Step, x, plan_mesh: Mesh): ...

    def slice_shared(self, step: LocalSlice, x, plan_mesh: Mesh):
        """A local slice of a value every member of the group holds alike (invariant over the
        step's axes): its transpose is an all-gather over them (``vary`` then the slice, fused)."""

    def vary(self, x, axes: tuple[str, ...], *, param: tuple[str, Layout] | None = None):
        """Identity forward; the gradient is summed over ``axes`` backward. ``param``: (name,
        layout) when ``x`` is a parameter as stored (a backend may bucket its gradient sum)."""

    def psum(self, x, axes: tuple[str, ...]): ...

    def pmax(self, x, axes: tuple[str, ...]): ...

    def axis_index(self, axes: tuple[str, ...]):
        """This rank's position in its group over ``axes`` (first axis major): an int, or a
        traced/per-rank integer."""

    def all_gather_many(self, xs: Sequence, dims: Sequence[int], axes: tuple[str, ...]) -> list:
        """Several all-gathers over one group (a backend may fuse them into one collective)."""

    def check(self, x: Sharded) -> None:
        """A backend that tracks variance itself (JAX) checks the executor's bookkeeping here."""


@dataclass(frozen=True)
class Fault:
    """A planted bug, to watch the checks catch it. ``kind``: ``"drop-all-reduce"`` (forward
    all-reduces run while ``layer`` is the latest layer asked for its parameters return their
    input), or ``"skip-vary-before-slice"`` (the variance rule is not applied before a local
    slice: the bug class of a slice whose transpose sums copies)."""

    kind: str
    layer: str = ""

    def __post_init__(self):
        if self.kind not in ("drop-all-reduce", "skip-vary-before-slice"):
            raise ValueError(f"Fault kind {self.kind!r}: choose 'drop-all-reduce' or 'skip-vary-before-slice'.")


@dataclass
class Hooks:
    """Observers and faults of one forward. ``tap(plan, i, before, after)`` sees every plan step;
    ``plans`` collects every plan run; ``fault`` plants a bug."""

    tap: Callable | None = None
    plans: list | None = None
    fault: Fault | None = None


def _layout_axes(layout: Layout) -> frozenset:
    return frozenset(layout.spec.axes) | frozenset(layout.partial)


def param_groups(names: Sequence[str]) -> dict[str, str]:
    """FSDP's units: parameters named ``<prefix>.<i>.…`` (a repeated block) group by
    ``<prefix>.<i>``, others by their first name component. name -> group."""
    out = {}
    for n in names:
        parts = n.split(".")
        out[n] = ".".join(parts[:2]) if len(parts) > 2 and parts[1].isdigit() else parts[0]
    return out


def group_members(params: Mapping[str, Sharded], dims: Mapping[str, LogicalDims]) -> dict[str, tuple[str, list]]:
    """``ShardedOps``' ``groups`` argument for these stored parameters (``param_groups``' units)."""
    units = param_groups(list(params))
    members: dict[str, list] = {}
    for name, value in params.items():
        members.setdefault(units[name], []).append((name, value, dims[name]))
    return {name: (units[name], members[units[name]]) for name in params}


class ShardedOps:
    """``Ops`` on ``Sharded`` values through ``comm``. ``activation(dims, shape)`` and
    ``compute(name)`` give the layouts of constraint points and of parameters in use;
    ``groups`` (name -> (group, [(name, value, dims) of its members])) gathers a group's
    parameters in one collective at its first use (FSDP's units); ``training`` turns dropout on,
    with ``rng``'s (seed, step). ``dtype``: mixed precision's compute dtype (core/precision.py):
    floating operands are cast to it where an op computes, after their collectives, and a value
    in it is widened to float32 for any collective that sums in either direction. ``order``: the
    sequence's zigzag layout (core/ring.py), which the ops that see positions follow: causal
    attention, rotary tables and parameters with a ``seq`` dim."""

    def __init__(self, comm: Comm, *, activation: Callable[[LogicalDims, tuple], Layout],
                 compute: Callable[[str], Layout], groups: Mapping[str, str] | None = None,
                 hooks: Hooks | None = None, training: bool = True, rng: DropoutKey | None = None,
                 dtype: str | None = None, order: SeqOrder | None = None, narrow_sums: bool = False):
        self.comm, self.mesh, self.local = comm, comm.mesh, comm.local
        self.dtype, self.order = dtype, order
        self.narrow_sums = narrow_sums  # an activation's collectives sum in the compute dtype (core/precision.py)
        self._perm = None  # the order's permutation as this backend's constant, made at first use
        self._activation, self._compute = activation, compute
        self.groups = groups
        self.hooks = hooks or Hooks()
        self.training, self.rng = training, rng or DropoutKey()
        self.scope = ""  # the layer of the latest parameter asked for (faults and the bisect use it)
        self._done: set[str] = set()
        self._gathered: dict[str, Sharded] = {}
        self._recent: list[tuple[Sharded, tuple, Sharded]] = []  # einsum operands' moves (``_moved``)

    # -- values ---------------------------------------------------------------------------------
    def _make(self, local, layout: Layout, shape, varying) -> Sharded:
        out = Sharded(local, layout, tuple(shape), frozenset(varying) | _layout_axes(layout))
        self.comm.check(out)
        return out

    def _like(self, x: Sharded, local) -> Sharded:
        return self._make(local, x.layout, x.shape, x.varying)

    # -- mixed precision (core/precision.py) ------------------------------------------------------------
    def _c(self, *xs: Sharded) -> list[Sharded]:
        """The values in the compute dtype (cast where the op computes: a parameter's collectives
        and its gradient's sums ran before, in float32)."""
        if self.dtype is None:
            return list(xs)
        return [dataclasses.replace(x, local=self.local.astype(x.local, self.dtype)) for x in xs]

    def _narrow(self, local) -> bool:
        """Whether ``local`` is a float of fewer bits than the sums run in (it widens for them)."""
        return self.dtype is not None and _is_float(local) and _itemsize(local) < 4

    def _wide(self, local):
        return self.local.astype(local, "float32") if self._narrow(local) else local

    def _widens(self, local) -> bool:
        """Whether ``local`` widens to float32 for a collective that sums (not where the policy
        sums activations in the compute dtype: ``narrow_sums``)."""
        return self._narrow(local) and not self.narrow_sums

    def _needs(self, axes, have) -> tuple[str, ...]:
        return tuple(a for a in self.mesh.axis_names if a in axes and a not in have and self.mesh.axis_size(a) > 1)

    def _vary_to(self, x: Sharded, axes) -> Sharded:
        missing = self._needs(axes, x.varying)
        # Varying over an axis of size 1 changes nothing but the account (JAX keeps the same one).
        trivial = {a for a in axes if a not in x.varying and self.mesh.has_axis(a) and self.mesh.axis_size(a) == 1}
        if not missing:
            return dataclasses.replace(x, varying=x.varying | trivial) if trivial else x
        param = (x.name, x.layout) if x.name is not None else None
        wide = self._widens(x.local)  # its backward sums: in float32 (or, narrow_sums, the compute dtype)
        local = self.comm.vary(self.local.astype(x.local, "float32") if wide else x.local, missing, param=param)
        local = self.local.astype(local, self.dtype) if wide else local
        return Sharded(local, x.layout, x.shape, x.varying | set(missing) | trivial)

    def _align(self, *xs: Sharded) -> list[Sharded]:
        union = frozenset().union(*(x.varying for x in xs))
        return [self._vary_to(x, union) for x in xs]

    def _vary_local(self, v, have, want):
        """A local statistic (invariant over ``want`` - ``have``) used with values varying over ``want``."""
        missing = self._needs(want, have)
        return self.comm.vary(v, missing) if missing else v

    # -- moving data ---------------------------------------------------------------------------------
    def _run(self, plan: Plan, x: Sharded) -> Sharded:
        if not plan.steps:  # the same data (the layouts differ by size-1 axes, if at all): keep the value,
            # and a parameter's name only where its layout is the stored one (its gradient's bucket needs it)
            return dataclasses.replace(x, layout=plan.dst, name=x.name if plan.dst == x.layout else None)
        hooks = self.hooks
        if hooks.plans is not None:
            hooks.plans.append(plan)
        narrow = self._widens(x.local) and _sums(plan)
        local, varying = (self._wide(x.local) if narrow else x.local), set(x.varying)
        fault = hooks.fault
        for i, step in enumerate(plan.steps):
            base = {a.partition(".")[0] for a in getattr(step, "axes", ())}
            run, dropped = self.comm.run_step, False
            if isinstance(step, LocalSlice) and not (fault and fault.kind == "skip-vary-before-slice"):
                # A slice of a value the group's members share: vary it first, so the slice's
                # transpose pads with zeros and the gradient is summed once, by vary's backward.
                # Shared over exactly the axes it is sliced over (whole), the two fuse into one
                # step whose transpose is an all-gather: half the bytes of vary's all-reduce.
                missing = self._needs(base, varying)
                if missing and set(missing) == {a for a in base if self.mesh.axis_size(a) > 1} and \
                        all(_covers(step.axes, a, plan.mesh) for a in missing):
                    run = self.comm.slice_shared
                elif missing:
                    local = self.comm.vary(local, missing)
                    varying |= set(missing)
            elif isinstance(step, Permute):
                # Blocks move to ranks that differ on any axis: the value varies over all of them
                # (size-1 axes too, in the account: JAX's permute over every axis counts them).
                missing = self._needs(self.mesh.axis_names, varying)
                if missing:
                    local = self.comm.vary(local, missing)
                varying |= set(self.mesh.axis_names)
            if (fault and fault.kind == "drop-all-reduce" and isinstance(step, AllReduce)
                    and (self.scope + ".").startswith(fault.layer + ".")):
                out, dropped = local, True  # the addends stay as they were: still varying
            else:
                out = run(step, local, plan.mesh)
            if isinstance(step, AllReduce) and not dropped:
                # A sum over the group is the same on every member of it: invariant over every
                # axis it sums over whole (a sum over part of an axis leaves the rest varying).
                varying -= {a for a in base if _covers(step.axes, a, plan.mesh)}
            elif not isinstance(step, AllReduce):
                varying |= base
            if hooks.tap is not None:
                hooks.tap(plan, i, local, out)
            local = out
        if narrow:  # rounded back once, after the collectives
            local = self.local.astype(local, self.dtype)
        return self._make(local, plan.dst, x.shape, varying)

    def redistribute(self, x: Sharded, target: Layout) -> Sharded:
        if x.layout == target:
            return x
        plan = plan_redistribute(x.layout, target, x.shape, itemsize=_itemsize(x.local))
        if self._widens(x.local) and _sums(plan):  # it runs in float32: its bytes are float32's
            plan = plan_redistribute(x.layout, target, x.shape, itemsize=4)
        return self._run(plan, x)

    def complete(self, x: Sharded) -> Sharded:
        """Sum pending partials (a nonlinear op needs whole values)."""
        return self.redistribute(x, x.layout.replace(partial=())) if x.layout.partial else x

    def finish_loss(self, x: Sharded) -> Sharded:
        """A scalar loss, the same on every rank in the account too. A complete scalar is whole on
        every rank; where it was computed from gathered (varying) values, each rank's copy would
        contribute the whole gradient, so the copies are averaged: psum(loss / n) over those axes
        (identity forward, each copy's gradient 1/n backward)."""
        x = self.complete(x)
        axes = tuple(a for a in self.mesh.axis_names if a in x.varying)  # size-1 axes too: invariant everywhere
        if not axes:
            return x
        n = self.mesh.group_size(axes)
        return self._make(self.comm.psum(x.local * (1.0 / n), axes), x.layout, x.shape, x.varying - set(axes))

    def _back(self, out, like):
        """A float32 result in ``like``'s dtype (a narrow input's)."""
        return self.local.astype(out, self.dtype) if self._narrow(like) else out

    def _index(self, axes):
        return self.comm.axis_index(tuple(axes)) if axes else 0

    # -- parameters, constraint points, constants -------------------------------------------------------
    def param(self, name: str, value: Sharded, dims: LogicalDims) -> Sharded:
        self.scope = name.rsplit(".", 1)[0]
        if self.groups is not None and name in self.groups:
            group, members = self.groups[name]
            if group not in self._done:  # the group's first use: one collective for all of it
                self._done.add(group)
                self._gather_group(members)
        if name in self._gathered:
            out = self._gathered.pop(name)
        else:
            out = self.redistribute(value, self._compute(name))
        return self._in_order(out, name, dims)

    def _in_order(self, x: Sharded, name: str, dims: LogicalDims) -> Sharded:
        """A parameter indexed by sequence position (a learned position table), its rows in the
        zigzag order of the data (a gather: its gradient scatters back)."""
        if self.order is None or "seq" not in dims:
            return x
        d = list(dims).index("seq")
        if d != 0 or x.layout.dim_axes(0) or x.shape[0] != self.order.seq:
            raise ValueError(f"parameter {name!r} (dims {tuple(dims)}, shape {x.shape}, used as {x.layout}) is indexed "
                             f"by sequence position, and the sequence is laid out zigzag over {list(self.order.axes)}: "
                             f"parlay reorders such a parameter's rows where it is used, which needs 'seq' to be its "
                             f"first dim, {self.order.seq} long, and whole where used; or use ring_contiguous.")
        return self._rows_in_order(x)

    def _rows_in_order(self, x: Sharded) -> Sharded:
        """``x`` (whole along dim 0, one row per position) with its rows in the zigzag order."""
        if self._perm is None:
            self._perm = self.local.constant(self.order.perm.astype(np.int32))
        return self._like(x, self.local.take(x.local, self._perm))

    def _gather_group(self, members: Sequence[tuple[str, Sharded, LogicalDims]]) -> None:
        """FSDP's flat parameter: the parameters of one group whose plans are each one all-gather
        over the same axes are gathered in one collective; ``param`` then hands them out."""
        batches: dict = {}
        for name, value, dims in members:
            target = self._compute(name)
            plan = plan_redistribute(value.layout, target, value.shape, itemsize=_itemsize(value.local))
            if len(plan.steps) == 1 and isinstance(plan.steps[0], AllGather) and plan.mesh == self.mesh:
                batches.setdefault(plan.steps[0].axes, []).append((name, value, plan.steps[0].dim, target, plan))
        for axes, items in batches.items():
            if len(items) < 2:
                continue
            if self.hooks.plans is not None:
                self.hooks.plans.extend(item[4] for item in items)
            outs = self.comm.all_gather_many([v.local for _, v, _, _, _ in items], [d for _, _, d, _, _ in items], axes)
            for (name, value, _, target, plan), out in zip(items, outs):
                if self.hooks.tap is not None:  # each tensor's part of the fused gather is its plan's one step
                    self.hooks.tap(plan, 0, value.local, out)
                self._gathered[name] = self._make(out, target, value.shape, value.varying | set(axes))

    def constrain(self, x: Sharded, dims: LogicalDims) -> Sharded:
        return self.redistribute(x, self._activation(dims, x.shape))

    def constant(self, value) -> Sharded:
        value = np.asarray(value)
        return self._make(self.local.constant(value), Layout(self.mesh, P()), value.shape, ())

    # -- linear algebra ---------------------------------------------------------------------------------
    def einsum(self, equation: str, *operands: Sharded) -> Sharded:
        plan = plan_einsum(equation, [o.layout for o in operands], [o.shape for o in operands],
                           itemsize=_itemsize(operands[0].local))
        varied = self._vary_early(plan.operand_plans, operands)
        moved = self._c(*self._align(*(self._moved(p, v, o) for p, v, o in zip(plan.operand_plans, varied, operands))))
        out = self.local.einsum(equation, *(m.local for m in moved))
        return self._make(out, plan.out, plan.out_shape, moved[0].varying)

    def _moved(self, plan: Plan, x: Sharded, value: Sharded) -> Sharded:
        """``plan`` run on ``x`` (``value`` as ``_vary_early`` left it), once per value: q, k and v
        (SwiGLU's two inputs) are einsums of one normed activation, and under 2D/2.5D/3D each would
        gather it again (and reduce-scatter its gradient again). The last few moves are kept, for
        activations only (a parameter is the same object in every microbatch a stage runs), and
        never across a checkpointed layer's boundary (``forget``): the recomputation moves its own."""
        if not plan.steps or value.name is not None:
            return self._run(plan, x)
        key = (plan.dst, x.varying)
        for seen, k, out in self._recent:
            if seen is value and k == key:
                return out
        out = self._run(plan, x)
        self._recent = [(value, key, out)] + self._recent[:3]
        return out

    def forget(self) -> None:
        """Drop the kept moves (a checkpointed layer starts and ends with none: ``core/remat.py``)."""
        self._recent = []

    def _vary_early(self, plans: Sequence[Plan], operands: Sequence[Sharded]) -> list[Sharded]:
        """Operands whose plans gather (the block grows) varied before their plans, over the axes
        the others will vary over that their own plan does not touch: the backward then sums the
        gradient over those axes on the block as it was, not the gathered one (2.5D's weight,
        replicated over dep and gathered over row: its gradient's sum over dep on 1/q the bytes).
        Plans that sum (an all-reduce) or permute change the variance otherwise: left as they were."""
        if any(isinstance(s, (AllReduce, Permute)) for p in plans for s in p.steps):
            return list(operands)
        touched = [{a.partition(".")[0] for s in p.steps for a in getattr(s, "axes", ())} for p in plans]
        want = frozenset().union(*(o.varying | t for o, t in zip(operands, touched)))
        out = []
        for p, o, t in zip(plans, operands, touched):
            missing = [a for a in self._needs(want, o.varying) if a not in t]
            grows = math.prod(p.dst.local_shape(o.shape)) > math.prod(p.src.local_shape(o.shape))
            out.append(self._vary_to(o, missing) if missing and grows else o)
        return out

    def _same(self, x: Sharded, y: Sharded, op: str) -> tuple[Sharded, Sharded]:
        """Both operands in one layout: x's, complete unless both hold the same pending sums (their
        shapes were checked when the program traced the model)."""
        if x.layout != y.layout:
            x = self.complete(x)
            y = self.redistribute(self.complete(y), x.layout)
        return tuple(self._align(x, y))

    def add(self, x: Sharded, y: Sharded) -> Sharded:
        x, y = self._c(*self._same(x, y, "add"))
        return self._like(x, x.local + y.local)

    def mul(self, x: Sharded, y: Sharded) -> Sharded:
        x, y = self._c(*self._same(self.complete(x), self.complete(y), "mul"))
        return self._like(x, x.local * y.local)

    def add_bias(self, x: Sharded, b: Sharded) -> Sharded:
        """b split like x's trailing dims and varied like x (x's partial axes included: its
        gradient is summed there). Where x holds pending sums, only the ranks at index 0 of its
        partial axes add b; the others add b * 0, so every rank joins b's gradient sum."""
        if b.shape != x.shape[x.ndim - b.ndim:]:
            raise ValueError(f"add_bias: the bias has shape {b.shape}, not x's trailing dims {x.shape[x.ndim - b.ndim:]} "
                             f"(x: {x.shape}).")
        b = self.redistribute(self.complete(b), bias_layout(x.layout, x.ndim, b.ndim))
        x, b = self._c(*self._align(x, b))
        bias = b.local
        if x.layout.partial:
            bias = bias * self.local.cast(self._index(x.layout.partial) == 0, bias)
        return self._like(x, x.local + bias)

    def scale(self, x: Sharded, c: float) -> Sharded:
        return self._like(x, x.local * float(c))  # linear: a pending sum's addends scale alike

    def _unary(self, x: Sharded, fn) -> Sharded:
        (x,) = self._c(self.complete(x))
        return self._like(x, fn(x.local))

    def __getattr__(self, name: str):
        if name in ELEMENTWISE:  # gelu, silu, relu, tanh: blockwise on complete values
            return lambda x: self._unary(x, getattr(self.local, name))
        raise AttributeError(f"{type(self).__name__} has no op {name!r}")

    # -- reductions -------------------------------------------------------------------------------------
    def sum(self, x: Sharded, dim: int) -> Sharded:
        d = _dim(dim, x.ndim, "sum")
        out = self.local.sum(self._wide(x.local), d)  # sums in float32 (core/precision.py)
        return self._make(out, reduce_layout(x.layout, x.ndim, d), x.shape[:d] + x.shape[d + 1:], x.varying)

    def mean(self, x: Sharded, dim: int) -> Sharded:
        d = _dim(dim, x.ndim, "mean")
        s = self.sum(x, d)
        return self._like(s, s.local * (1.0 / x.shape[d]))

    def softmax(self, x: Sharded, dim: int = -1) -> Sharded:
        d = _dim(dim, x.ndim, "softmax")
        (x,) = self._c(self.complete(x))
        axes = x.layout.dim_axes(d)
        if not axes:
            return self._like(x, self.local.softmax(x.local, d))
        w = self._wide(x.local)  # in float32, back in the compute dtype at the end
        m = self.comm.pmax(self.local.max(w, d, keepdim=True), axes)  # a shift: no gradient
        e = self.local.exp(w - m)
        s = self._vary_local(self.comm.psum(self.local.sum(e, d, keepdim=True), axes), x.varying - set(axes), x.varying)
        return self._like(x, self._back(e / s, x.local))

    def _last_dim(self, x: Sharded, *params: Sharded):
        (x,) = self._c(self.complete(x))
        axes = x.layout.dim_axes(x.ndim - 1)
        vec = vector_layout(x.layout, x.ndim)
        aligned = self._align(x, *(self.redistribute(self.complete(p), vec) for p in params))
        return aligned[0], axes, aligned[1:]

    def _sum_last(self, v, x: Sharded, axes):
        """The sum of ``v`` over the last dim of ``x``'s layout, whole, varied like ``x``."""
        s = self.local.sum(v, -1, keepdim=True)
        if not axes:
            return s
        return self._vary_local(self.comm.psum(s, axes), x.varying - set(axes), x.varying)

    def rms_norm(self, x: Sharded, scale: Sharded, eps: float) -> Sharded:
        x, axes, (scale,) = self._last_dim(x, scale)
        if not axes:  # whole rows: the backend's own (maybe fused) norm
            return self._like(x, self.local.rms_norm(x.local, scale.local, eps))
        w = self._wide(x.local)  # the statistics in float32
        ms = self._sum_last(w * w, x, axes) * (1.0 / x.shape[-1])
        return self._like(x, self._back(w * self.local.rsqrt(ms + eps) * scale.local, x.local))

    def layer_norm(self, x: Sharded, scale: Sharded, bias: Sharded, eps: float) -> Sharded:
        x, axes, (scale, bias) = self._last_dim(x, scale, bias)
        if not axes:
            return self._like(x, self.local.layer_norm(x.local, scale.local, bias.local, eps))
        n = 1.0 / x.shape[-1]
        w = self._wide(x.local)  # the statistics in float32
        mean = self._sum_last(w, x, axes) * n
        centered = w - mean
        var = self._sum_last(centered * centered, x, axes) * n
        return self._like(x, self._back(centered * self.local.rsqrt(var + eps) * scale.local + bias.local, x.local))

    # -- embedding, positions, attention, dropout, rearrange, loss ------------------------------------------
    def embed(self, table: Sharded, tokens: Sharded) -> Sharded:
        """Vocabulary-parallel lookup: ranks outside a token's vocab shard add zeros."""
        tokens = self.complete(tokens)
        target, out_layout = embed_layouts(table.layout, tokens.layout, tokens.ndim)
        table = self._vary_to(self.redistribute(self.complete(table), target), tokens.varying)  # rows of varying ids
        vocab_axes = target.dim_axes(0)
        v_local = table.shape[0] // target.shard_count(0)
        ids = tokens.local - self._index(vocab_axes) * v_local
        hit = (ids >= 0) & (ids < v_local)
        rows = self.local.take(table.local, self.local.where(hit, ids, ids * 0))
        out = rows * self.local.cast(hit, rows)[..., None]
        if self.dtype is not None:
            out = self.local.astype(out, self.dtype)
        return self._make(out, out_layout, tokens.shape + (table.shape[1],), table.varying | tokens.varying)

    def rotary(self, x: Sharded, cos: Sharded, sin: Sharded) -> Sharded:
        x = self.complete(x)
        if self.order is not None:  # the tables' rows in the data's zigzag order
            if cos.shape[0] != self.order.seq or cos.layout.dim_axes(0) or sin.layout.dim_axes(0):
                raise ValueError(f"rotary: tables of {cos.shape[0]} positions ({cos.layout}), but the sequence of "
                                 f"{self.order.seq} is laid out zigzag; give whole tables, one row per position.")
            cos, sin = self._rows_in_order(cos), self._rows_in_order(sin)
        target, table = rotary_layouts(x.layout)
        x = self.redistribute(x, target)
        x, cos, sin = self._c(x, self.redistribute(cos, table), self.redistribute(sin, table))
        # cos/sin are constants: no gradient, no need to vary them.
        return self._like(x, self.local.rotary(x.local, cos.local, sin.local))

    def attention(self, q: Sharded, k: Sharded, v: Sharded, *, causal: bool = True) -> Sharded:
        q = self.complete(q)
        target = attention_layout(q.layout)
        n = target.shard_count(2)
        if k.shape[2] % n:
            axes = " x ".join(f"{a}={self.mesh.axis_size(a)}" for a in target.dim_axes(2))
            raise ValueError(f"attention: the query heads are split over {axes} but k and v have {k.shape[2]} heads, "
                             f"not divisible by {n}; each rank's query heads use its own kv heads, so the kv heads are "
                             f"split like the query heads: use axes that divide {k.shape[2]}, or keep the heads whole.")
        q, k, v = self._c(*self._align(*(self.redistribute(self.complete(t), target) for t in (q, k, v))))
        axes = tuple(a for a in target.dim_axes(1) if self.mesh.axis_size(a) > 1)
        order = self.order
        if order is not None and causal and axes != order.axes:
            raise ValueError(f"attention: the sequence is laid out zigzag over {list(order.axes)}, but attention "
                             f"splits it over {list(axes) or 'nothing'}; a causal mask needs positions in order: "
                             f"split the attention's sequence ('attn_seq') over {list(order.axes)}, or use "
                             f"ring_contiguous (no zigzag).")
        if not axes:
            return self._like(q, self.local.attention(q.local, k.local, v.local, causal=causal))
        return self._like(q, self._ring(q, k, v, Ring(axes, self.mesh.group_size(axes), causal,
                                                     order is not None and causal, q.shape[1] // target.shard_count(1))))

    def _ring(self, q: Sharded, k: Sharded, v: Sharded, ring: Ring):
        """Ring attention over the sequence's axes (core/ring.py): one op with its own backward."""
        comm, L = self.comm, self.local

        def forward(q, k, v):
            index = comm.axis_index(ring.axes)
            o, lse = ring_forward(L, lambda t: comm.shift(t, ring.axes), index, ring, q, k, v)
            return o, (q, k, v, o, lse)

        def backward(res, do):
            index = comm.axis_index(ring.axes)
            return ring_backward(L, lambda t: comm.shift(t, ring.axes, backward=True), index, ring, *res, do)

        return comm.custom(forward, backward, q.local, k.local, v.local)

    def dropout(self, x: Sharded, rate: float, *, key: str) -> Sharded:
        """The mask is a function of each element's global index: the same on every layout, so
        pending sums keep it too (dropout is linear in x)."""
        if not self.training or rate == 0:
            return x
        if self.order is not None:
            raise ValueError(f"dropout ({key!r}, rate {rate}): the sequence is laid out zigzag over "
                             f"{list(self.order.axes)}, and dropout's bits follow each element's position, which "
                             f"dropout cannot see here; train without dropout, or use ring_contiguous.")
        local_shape = x.layout.local_shape(x.shape)
        coords = []
        for d, n in enumerate(local_shape):
            offset = self._index(x.layout.dim_axes(d)) * n
            coords.append(self.local.iota(local_shape, d) + offset)
        keep = dropout_keep(coords, rate, key, self.rng)
        return self._like(x, self.local.where(keep, x.local * (1.0 / (1.0 - rate)), x.local * 0.0))

    def rearrange(self, x: Sharded, pattern: str, **sizes: int) -> Sharded:
        r = parse_rearrange(pattern, x.shape, sizes)
        target, out_layout, local_sizes = rearrange_layouts(r, x.layout)
        x = self.redistribute(x, target)
        return self._make(self.local.rearrange(x.local, pattern, local_sizes), out_layout, r.out_shape, x.varying)

    def cross_entropy(self, logits: Sharded, targets: Sharded) -> Sharded:
        """Mean over every leading position; with the vocabulary sharded, max and sum-exp combine
        over its axes (Megatron's vocabulary-parallel loss)."""
        if targets.shape != logits.shape[:-1]:
            raise ValueError(f"cross_entropy: targets have shape {targets.shape}; logits {logits.shape} need targets "
                             f"of shape {logits.shape[:-1]} (every dim but the last).")
        (logits,) = self._c(self.complete(logits))  # as DenseOps does: the statistics then widen to float32
        targets = self.redistribute(self.complete(targets), loss_targets_layout(logits.layout, logits.ndim))
        logits, targets = self._align(logits, targets)  # targets gathered from shards vary: the loss does too
        vocab = logits.layout.dim_axes(logits.ndim - 1)
        v_local = logits.shape[-1] // logits.layout.shard_count(logits.ndim - 1)
        ids = targets.local - self._index(vocab) * v_local
        hit = (ids >= 0) & (ids < v_local)
        ids = self.local.where(hit, ids, ids * 0)
        have = logits.varying - set(vocab)

        def combine(m, se, picked):
            if not vocab:
                return m, se, picked
            top = self.comm.pmax(m, vocab)
            return (top, self.comm.psum(se * self.local.exp(m - top), vocab),
                    self.comm.psum(picked, vocab))

        total = self.local.vocab_cross_entropy(logits.local, ids, hit, combine)  # (...) per position
        for _ in range(logits.ndim - 1):
            total = self.local.sum(total, 0)
        token_axes = tuple(a for d in range(logits.ndim - 1) for a in logits.layout.dim_axes(d))
        if token_axes:
            total = self.comm.psum(total, token_axes)
        count = int(np.prod(logits.shape[:-1]))
        return self._make(total * (1.0 / count), Layout(self.mesh, P()), (), have - set(token_axes))


def _covers(axes: tuple[str, ...], axis: str, plan_mesh: Mesh) -> bool:
    """Whether ``axes`` (of the plan's mesh) include the whole of mesh axis ``axis``."""
    parts = [a for a in plan_mesh.axis_names if a == axis or a.startswith(axis + ".")]
    return all(a in axes for a in parts)


def _dim(dim: int, ndim: int, op: str) -> int:
    if not -ndim <= dim < ndim:
        raise ValueError(f"{op}: dim {dim} is out of range for a tensor of {ndim} dims.")
    return dim % ndim


def _sums(plan: Plan) -> bool:
    """Whether a plan may sum in its forward or its backward: any step but an all-to-all (a
    local slice or a permute may need ``vary`` first, whose backward sums)."""
    return any(not isinstance(step, AllToAll) for step in plan.steps)


def _is_float(local) -> bool:
    dtype = getattr(local, "dtype", None)
    return bool(getattr(dtype, "is_floating_point", False)) or getattr(dtype, "kind", "") == "f" or \
        str(dtype) in ("bfloat16", "float16")


def _itemsize(local) -> int:
    dtype = getattr(local, "dtype", None)
    size = getattr(dtype, "itemsize", None)
    if size is None:  # torch dtypes
        size = local.element_size() if hasattr(local, "element_size") else 4
    return int(size)
