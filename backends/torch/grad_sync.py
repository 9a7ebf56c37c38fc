"""Data-parallel gradient sync in buckets that overlap the backward pass (as DDP does).

A parameter used where values vary over some axes (DP's batch split) has a partial gradient
there: the variance rule's ``vary`` would all-reduce it on the spot, one blocking call per
parameter. For parameters used directly (their stored layout is their compute layout), the
backward instead hands the gradient to a ``GradSync``: gradients are copied into a flat bucket
per set of axes; a full bucket starts an asynchronous all-reduce while backward goes on; ``finish``
waits for the last ones and adds the sums into ``param.grad``. A parameter used twice (a tied
embedding) hands over two partial gradients; each is summed over the ranks and both are added.

Gradient accumulation (``defer``): while a step's earlier microbatches run backward, the partial
gradients are summed on this rank only; the backward that ends the step reduces the sums, so a
step issues the collectives of one batch whatever its number of microbatches (DDP's ``no_sync``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...core import Kind, Layout, plan_redistribute
from ...core.log import CollectiveLog, Source
from .collectives import run_plan
from .mesh import TorchMesh

__all__ = ["GradSync", "vary_param"]


class GradSync:
    def __init__(self, tm: TorchMesh, *, bucket_bytes: int = 25 * 2**20, log: CollectiveLog | None = None,
                 grad_layouts: dict | None = None):
        """``grad_layouts``: name -> the layout a parameter's gradient must end in. Where it is
        not the parameter's own (ZeRO-2), the partial gradient goes through the core plan from
        partial to that layout (a reduce-scatter) into ``sharded[name]``, and ``param.grad``
        stays None: no rank holds a whole gradient."""
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes}; give a positive size (DDP's default is 25 MiB).")
        self.tm, self.bucket_bytes, self.log = tm, bucket_bytes, log
        self.grad_layouts = grad_layouts or {}
        self.sharded: dict[str, torch.Tensor] = {}
        self._open: dict[tuple, list] = {}  # axes -> [(param, grad)]
        self._sizes: dict[tuple, int] = {}
        self._inflight: list = []  # (work, flat, [(param, numel)])
        self._queued = False
        self.defer = False  # hold partial gradients on this rank (a step's earlier microbatches)
        self._held: dict = {}  # ("param", id(param), axes) or ("sharded", name, layout, axes) -> held sum
        self._params: dict = {}  # id(param) -> param, for the held sums

    def reduce_to_layout(self, name: str, layout: Layout, grad: torch.Tensor, axes: tuple[str, ...]) -> None:
        key = ("sharded", name, layout, axes)
        if self.defer:
            self._hold(key, grad)
            return
        held = self._held.pop(key, None)
        if held is not None:
            grad = grad + held
        plan = plan_redistribute(layout.replace(partial=axes), self.grad_layouts[name],
                                 layout.global_shape(grad.shape), itemsize=grad.element_size())
        with torch.no_grad():
            out = run_plan(plan, grad.detach(), self.tm)
        if self.log is not None:
            for step, sent in zip(plan.steps, plan.step_bytes):
                self.log.record(step.kind, getattr(step, "axes", ()), sent[self.tm.rank], True, Source.OP, grad.dtype)
        self.sharded[name] = out if name not in self.sharded else self.sharded[name] + out

    def wants_layout(self, name: str, layout) -> bool:
        return name in self.grad_layouts and self.grad_layouts[name] != layout

    def _hold(self, key, grad: torch.Tensor) -> None:
        with torch.no_grad():
            self._held[key] = grad.detach().clone() if key not in self._held else self._held[key] + grad.detach()

    def release(self) -> None:
        """Reduce whatever is still held (a step whose last backward did not reach a parameter)."""
        self.defer = False
        for key in list(self._held):
            if key[0] == "sharded":
                _, name, layout, axes = key
                self.reduce_to_layout(name, layout, torch.zeros_like(self._held[key]), axes)
            else:
                _, pid, axes = key
                self.add(self._params[pid], torch.zeros_like(self._held[key]), axes)
        self.finish()

    def add(self, param: torch.Tensor, grad: torch.Tensor, axes: tuple[str, ...]) -> None:
        key = ("param", id(param), axes)
        if self.defer:
            self._params[id(param)] = param
            self._hold(key, grad)
            return
        held = self._held.pop(key, None)
        if held is not None:
            grad = grad + held
        self._open.setdefault(axes, []).append((param, grad.detach().reshape(-1)))
        self._sizes[axes] = self._sizes.get(axes, 0) + grad.numel() * grad.element_size()
        if self._sizes[axes] >= self.bucket_bytes:
            self._flush(axes)

    def _flush(self, axes) -> None:
        entries = self._open.pop(axes, [])
        self._sizes.pop(axes, None)
        if not entries:
            return
        flat = torch.cat([g for _, g in entries])
        pg, members = self.tm.group(axes)
        work = dist.all_reduce(flat, group=pg, async_op=True)
        if self.log is not None:
            n = len(members)
            self.log.record(Kind.ALL_REDUCE, axes, 2 * (n - 1) * flat.numel() // n * flat.element_size(), True, Source.OP,
                            flat.dtype)
        self._inflight.append((work, flat, [(p, g.numel()) for p, g in entries]))

    def queue_finish(self) -> None:
        """Have autograd call ``finish`` when this backward pass ends (as DDP does), so a plain
        ``loss.backward()`` on the session's module syncs the gradients too."""
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)

    def finish(self) -> None:
        """Wait for every bucket and set each parameter's gradient to its sum (idempotent)."""
        self._queued = False
        for axes in sorted(self._open):
            self._flush(axes)
        for work, flat, params in self._inflight:
            work.wait()
            offset = 0
            for p, n in params:
                summed = flat[offset:offset + n].view_as(p)
                if p.grad is None:
                    p.grad = summed.clone()
                else:  # another use of p, or a gradient autograd already holds (summed elsewhere)
                    p.grad.add_(summed)
                offset += n
        self._inflight.clear()


class _VaryParam(torch.autograd.Function):
    @staticmethod
    def forward(ctx, p, name, layout, axes, sync):
        ctx.sync, ctx.axes, ctx.param, ctx.name, ctx.layout = sync, axes, p, name, layout
        return p.view_as(p)

    @staticmethod
    def backward(ctx, g):
        ctx.sync.queue_finish()
        if ctx.sync.wants_layout(ctx.name, ctx.layout):
            ctx.sync.reduce_to_layout(ctx.name, ctx.layout, g, ctx.axes)
            return None, None, None, None, None  # the gradient lives in sync.sharded only
        ctx.sync.add(ctx.param, g, ctx.axes)
        # The partial gradient stays out of autograd (which may reuse its buffer for a second use
        # of the parameter); GradSync.finish adds its sum to param.grad.
        return None, None, None, None, None


def vary_param(p: torch.Tensor, name: str, layout, axes: tuple[str, ...], sync: GradSync) -> torch.Tensor:
    return _VaryParam.apply(p, name, layout, tuple(axes), sync)
