"""The neutral ops on local shards over torch.distributed.

Each value is a ``Sharded``: the local block, its core ``Layout``, its global shape, and the mesh
axes it *varies* over (its layout's axes, plus axes it picked up from varying operands). Ops run
the core's plans (``plan_einsum``, ``plan_redistribute``) with autograd collectives, and apply
the variance rule: an operand invariant over an axis another operand varies over goes through
``vary`` (identity forward, all-reduce of its gradient backward). JAX's shard_map does this
bookkeeping itself; here it is explicit, and it is what makes data-parallel gradient sync and
Megatron's f operator appear without a line of strategy code.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ...core import AllGather, AllReduce, Layout, LocalSlice, P, Permute, ReduceScatter, plan_einsum, plan_redistribute
from ...core.operand_layouts import (attention_layout, bias_layout, embed_layouts, loss_targets_layout,
                                      rotary_layouts, vector_layout)
from ...core.ops import LogicalDims
from .collectives import CollectiveLog, all_gather_many, all_reduce, run_step, vary
from .grad_sync import GradSync, vary_param
from .mesh import TorchMesh
from .ops import TorchOps

__all__ = ["Sharded", "ExplicitOps"]


@dataclass(frozen=True)
class Sharded:
    local: torch.Tensor
    layout: Layout
    shape: tuple[int, ...]
    varying: frozenset = frozenset()
    name: str | None = None  # set on a parameter as stored (its gradient may go to a GradSync)

    @property
    def ndim(self) -> int:
        return len(self.shape)


def _layout_axes(layout: Layout) -> frozenset:
    return frozenset(layout.spec.axes) | frozenset(layout.partial)


class ExplicitOps:
    def __init__(self, tm: TorchMesh, *, activation: Callable[[LogicalDims], P],
                 compute: Callable[[str, LogicalDims], P], log: CollectiveLog | None = None,
                 grad_sync: "GradSync | None" = None, device: torch.device | str = "cpu"):
        self.tm, self.mesh, self.device = tm, tm.mesh, torch.device(device)
        self.grad_sync = grad_sync
        # name -> the (name, value, logical dims) of its group, for coalesced gathers (or None)
        self.param_groups: dict | None = None
        self._gathered: dict = {}
        self.plans: list = []  # every plan run, in order (with its steps' bytes per rank)
        self._activation, self._compute = activation, compute
        self.log = log
        self.tap = None  # called with (plan, step index, local before, local after) for every plan step
        self._local = TorchOps()

    # -- variance ------------------------------------------------------------------------------------
    def _vary_to(self, x: Sharded, axes: frozenset) -> Sharded:
        missing = [a for a in self.mesh.axis_names if a in axes and a not in x.varying and self.mesh.axis_size(a) > 1]
        if not missing:
            return x
        if self.grad_sync is not None and x.name is not None and x.local.is_leaf and x.local.requires_grad:
            # A parameter used as stored: its gradient sum joins a bucket that overlaps backward,
            # or (ZeRO-2) is reduce-scattered straight into its shard.
            local = vary_param(x.local, x.name, x.layout, tuple(missing), self.grad_sync)
        else:
            local = vary(x.local, tuple(missing), self.tm, self.log)
        return Sharded(local, x.layout, x.shape, x.varying | set(missing))

    def _align(self, *xs: Sharded) -> list[Sharded]:
        union = frozenset().union(*(x.varying for x in xs))
        return [self._vary_to(x, union) for x in xs]

    # -- moving data ------------------------------------------------------------------------------------
    def _run(self, plan, x: Sharded) -> Sharded:
        if not plan.steps:  # the same data: keep the value (and a parameter's name)
            return dataclasses.replace(x, layout=plan.dst)
        self.plans.append(plan)
        local, varying = x.local, set(x.varying)
        for i, step in enumerate(plan.steps):
            axes = getattr(step, "axes", ())
            base = {a.partition(".")[0] for a in axes}
            if isinstance(step, (AllGather, ReduceScatter, LocalSlice)):
                varying |= base
            elif isinstance(step, AllReduce):
                # A sum over the group is the same on every member of it.
                varying -= base
            elif isinstance(step, Permute):
                # Point-to-point moves: a shard replicated over some axes arrives on ranks that
                # differ there, so it must vary over them first (JAX's ppermute does the same).
                rest = [a for a in self.mesh.axis_names if a not in varying and self.mesh.axis_size(a) > 1]
                local = vary(local, tuple(rest), self.tm, self.log)
                varying |= set(self.mesh.axis_names)
            before, local = local, run_step(step, local, self.tm, plan.mesh, self.log)
            if self.tap is not None:
                self.tap(plan, i, before, local)
        return Sharded(local, plan.dst, x.shape, frozenset(varying) | _layout_axes(plan.dst))

    def redistribute(self, x: Sharded, target: Layout) -> Sharded:
        if x.layout == target:
            return x
        return self._run(plan_redistribute(x.layout, target, x.shape, itemsize=x.local.element_size()), x)

    def complete(self, x: Sharded) -> Sharded:
        return self.redistribute(x, x.layout.replace(partial=())) if x.layout.partial else x

    def _index(self, axes) -> int:
        idx = 0
        for a in axes:
            idx = idx * self.mesh.axis_size(a) + self.mesh.coord(self.tm.rank, a)
        return idx

    def param(self, name: str, value: Sharded, dims: LogicalDims) -> Sharded:
        if name in self._gathered:
            return self._gathered.pop(name)
        target = Layout(self.mesh, self._compute(name, dims))
        if self.param_groups is not None and name in self.param_groups:
            self._gather_group(self.param_groups[name])
            if name in self._gathered:
                return self._gathered.pop(name)
        return self.redistribute(value, target)

    def _gather_group(self, members) -> None:
        """FSDP's flat parameter: every parameter of a group (a block) whose plan is one
        all-gather over the same axes is gathered in one collective, at the group's first use."""
        batches: dict = {}
        for name, value, dims in members:
            if name in self._gathered:
                continue
            target = Layout(self.mesh, self._compute(name, dims))
            plan = plan_redistribute(value.layout, target, value.shape, itemsize=value.local.element_size())
            if len(plan.steps) == 1 and isinstance(plan.steps[0], AllGather) and plan.mesh == self.mesh:
                batches.setdefault(plan.steps[0].axes, []).append((name, value, plan.steps[0].dim, target))
        for axes, items in batches.items():
            outs = all_gather_many([v.local for _, v, _, _ in items], [d for _, _, d, _ in items], axes,
                                   self.tm, None, self.log)
            for (name, value, _, target), out in zip(items, outs):
                self._gathered[name] = Sharded(out, target, value.shape,
                                               value.varying | set(axes) | _layout_axes(target))

    def constrain(self, x: Sharded, dims: LogicalDims) -> Sharded:
        return self.redistribute(x, Layout(self.mesh, self._activation(dims)))

    def constant(self, value) -> Sharded:
        value = np.asarray(value)
        return Sharded(torch.from_numpy(value).to(self.device), Layout(self.mesh, P()), value.shape)

    # -- linear algebra -------------------------------------------------------------------------------
    def einsum(self, equation: str, *operands: Sharded) -> Sharded:
        plan = plan_einsum(equation, [o.layout for o in operands], [o.shape for o in operands],
                           itemsize=operands[0].local.element_size())
        moved = self._align(*(self._run(p, o) for p, o in zip(plan.operand_plans, operands)))
        out = self._local.einsum(equation, *(m.local for m in moved))
        return Sharded(out, plan.out, plan.out_shape, moved[0].varying | _layout_axes(plan.out))

    def _same(self, x: Sharded, y: Sharded) -> tuple[Sharded, Sharded]:
        if x.layout != y.layout:
            x = self.complete(x)
            y = self.redistribute(self.complete(y), x.layout)
        x, y = self._align(x, y)
        return x, y

    def add(self, x: Sharded, y: Sharded) -> Sharded:
        x, y = self._same(x, y)
        return Sharded(x.local + y.local, x.layout, x.shape, x.varying)

    def mul(self, x: Sharded, y: Sharded) -> Sharded:
        x, y = self._same(self.complete(x), self.complete(y))
        return Sharded(x.local * y.local, x.layout, x.shape, x.varying)

    def add_bias(self, x: Sharded, b: Sharded) -> Sharded:
        """b split like x's trailing dims and varied like x (x's partial axes included: its
        gradient is summed there). Where x holds pending sums, only the ranks at index 0 of its
        partial axes add b; the others add b * 0, so every rank joins b's gradient all-reduce."""
        b = self.redistribute(self.complete(b), bias_layout(x.layout, x.ndim, b.ndim))
        x, b = self._align(x, b)
        bias = b.local * float(self._index(x.layout.partial) == 0) if x.layout.partial else b.local
        return Sharded(x.local + bias, x.layout, x.shape, x.varying)

    def _unary(self, x: Sharded, fn) -> Sharded:
        x = self.complete(x)
        return Sharded(fn(x.local), x.layout, x.shape, x.varying)

    def gelu(self, x: Sharded) -> Sharded:
        return self._unary(x, self._local.gelu)

    def silu(self, x: Sharded) -> Sharded:
        return self._unary(x, self._local.silu)

    # -- reductions over a possibly sharded last dim ---------------------------------------------------
    def _last_dim(self, x: Sharded, *params: Sharded):
        x = self.complete(x)
        axes = x.layout.dim_axes(x.ndim - 1)
        vec = vector_layout(x.layout, x.ndim)
        params = [self.redistribute(self.complete(p), vec) for p in params]
        aligned = self._align(x, *params)
        return aligned[0], axes, aligned[1:]

    def _sum_last(self, v: torch.Tensor, axes) -> torch.Tensor:
        return all_reduce(v.sum(-1, keepdim=True), axes, self.tm, self.log)

    def rms_norm(self, x: Sharded, scale: Sharded, eps: float) -> Sharded:
        x, axes, (scale,) = self._last_dim(x, scale)
        if not axes and self._local.uses_triton(x.local, scale.local):
            # Whole rows are local: the fused kernel. scale was varied with x in _last_dim, so its
            # gradient (the kernel's sum over local rows) is still summed where x varies.
            return Sharded(self._local.rms_norm(x.local, scale.local, eps), x.layout, x.shape, x.varying)
        ms = self._sum_last(x.local * x.local, axes) / x.shape[-1]
        # The statistic is the same across `axes`; used with x, which varies there, it is varied.
        ms = vary(ms, axes, self.tm, self.log)
        return Sharded(x.local * torch.rsqrt(ms + eps) * scale.local, x.layout, x.shape, x.varying)

    def layer_norm(self, x: Sharded, scale: Sharded, bias: Sharded, eps: float) -> Sharded:
        x, axes, (scale, bias) = self._last_dim(x, scale, bias)
        if not axes and self._local.uses_triton(x.local, scale.local, bias.local):
            out = self._local.layer_norm(x.local, scale.local, bias.local, eps)  # whole rows: fused
            return Sharded(out, x.layout, x.shape, x.varying)
        mean = vary(self._sum_last(x.local, axes) / x.shape[-1], axes, self.tm, self.log)
        var = vary(self._sum_last((x.local - mean) ** 2, axes) / x.shape[-1], axes, self.tm, self.log)
        out = (x.local - mean) * torch.rsqrt(var + eps) * scale.local + bias.local
        return Sharded(out, x.layout, x.shape, x.varying)

    # -- embedding, positions, attention, loss -----------------------------------------------------------
    def embed(self, table: Sharded, tokens: Sharded) -> Sharded:
        tokens = self.complete(tokens)
        target, out_layout = embed_layouts(table.layout, tokens.layout)
        table = self.redistribute(self.complete(table), target)
        vocab_axes = target.dim_axes(0)
        v_local = table.local.shape[0]
        ids = tokens.local - self._index(vocab_axes) * v_local
        hit = (ids >= 0) & (ids < v_local)
        table = self._vary_to(table, tokens.varying)  # rows looked up by varying tokens
        out = table.local[ids.clamp(0, v_local - 1)] * hit[..., None]
        return Sharded(out, out_layout, tokens.shape + (table.shape[1],),
                       table.varying | tokens.varying | _layout_axes(out_layout))

    def rotary(self, x: Sharded, cos: Sharded, sin: Sharded) -> Sharded:
        x = self.complete(x)
        target, table = rotary_layouts(x.layout)
        x = self.redistribute(x, target)
        cos, sin = self.redistribute(cos, table), self.redistribute(sin, table)
        # cos/sin are constants: no gradient, no need to vary them.
        return Sharded(self._local.rotary(x.local, cos.local, sin.local), x.layout, x.shape, x.varying)

    def attention(self, q: Sharded, k: Sharded, v: Sharded, *, causal: bool = True) -> Sharded:
        q = self.complete(q)
        target = attention_layout(q.layout)
        q, k, v = self._align(*(self.redistribute(self.complete(t), target) for t in (q, k, v)))
        return Sharded(self._local.attention(q.local, k.local, v.local, causal=causal), target, q.shape, q.varying)

    def cross_entropy(self, logits: Sharded, targets: Sharded) -> Sharded:
        logits = self.complete(logits)
        targets = self.redistribute(self.complete(targets), loss_targets_layout(logits.layout))
        vocab = logits.layout.dim_axes(2)
        l = logits.local
        if self._local.uses_triton(l):
            from ... import triton_kernels

            def combine(m, se, picked):
                # The same collectives as below: the max outside autograd, then the two sums. The
                # kernel's backward needs only the global log-sum-exp, so it is local.
                if vocab:
                    import torch.distributed as dist
                    top = m.clone()
                    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=self.tm.group(tuple(vocab))[0])
                    se, m = se * torch.exp(m - top), top
                return m, all_reduce(se, vocab, self.tm, self.log), all_reduce(picked, vocab, self.tm, self.log)

            start = self._index(vocab) * l.shape[-1]  # this rank's first vocab column
            rows = triton_kernels.vocab_parallel_cross_entropy(l, targets.local, vocab_start=start, combine=combine)
            total = rows.sum()  # rows: (B, S) local
        else:
            m = l.detach().amax(-1, keepdim=True)
            if vocab:  # a max is not a sum: reduce it outside autograd (the shift cancels in the loss)
                import torch.distributed as dist
                pg, _ = self.tm.group(tuple(vocab))
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=pg)
            se = all_reduce(torch.exp(l - m).sum(-1), vocab, self.tm, self.log)
            ids = targets.local - self._index(vocab) * l.shape[-1]
            hit = (ids >= 0) & (ids < l.shape[-1])
            picked = torch.gather(l, -1, ids.clamp(0, l.shape[-1] - 1)[..., None])[..., 0] * hit
            picked = all_reduce(picked, vocab, self.tm, self.log)
            total = (torch.log(se) + m[..., 0] - picked).sum()
        varying = logits.varying - set(vocab)
        token_axes = logits.layout.dim_axes(0) + logits.layout.dim_axes(1)
        total = all_reduce(total, token_axes, self.tm, self.log)
        varying -= set(token_axes)
        return Sharded(total / (logits.shape[0] * logits.shape[1]), Layout(self.mesh, P()), (), frozenset(varying))
