"""Core plan steps as torch autograd functions, each with its transpose as backward.

all-gather <-> reduce-scatter, all-to-all <-> the reverse all-to-all, a local slice -> zero
padding (its input varies over the sliced axes: the executor varies a shared value first),
all-reduce -> identity, a permute <-> the reverse permute. ``vary`` is the variance rule of
the executor: identity forward, all-reduce backward; the executor decides where it goes.

Group members follow the plan's order (first axis major); torch orders a group by global rank,
so chunks are permuted between the two where they differ.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...core import AllGather, AllReduce, AllToAll, Kind, LocalSlice, Permute, Plan, ReduceScatter, Step
from ...core.log import CollectiveLog, Source
from .mesh import TorchMesh

__all__ = ["run_step", "run_plan", "vary", "all_reduce", "all_max", "all_gather_many", "slice_shared"]


class _Ctx:
    """What a collective needs: the group, the member order, this rank's index, and the log."""

    def __init__(self, tm: TorchMesh, axes, plan_mesh, log: CollectiveLog | None, source: Source = Source.PLAN):
        self.axes, self.log, self.source = tuple(axes), log, source
        self.pg, self.members = tm.group(self.axes, plan_mesh)
        self.n = len(self.members)
        self.index = self.members.index(tm.rank)
        order = sorted(self.members)
        self.to_torch = [self.members.index(r) for r in order]  # torch slot j holds member to_torch[j]

    def note(self, kind: Kind, nbytes: int, backward: bool, dtype=""):
        if self.log is not None:
            self.log.record(kind, self.axes, nbytes, backward, self.source, dtype)


def _gather(x: torch.Tensor, dim: int, c: _Ctx, backward: bool) -> torch.Tensor:
    front = x.movedim(dim, 0).contiguous()
    out = torch.empty((c.n * front.shape[0],) + front.shape[1:], dtype=x.dtype, device=x.device)
    dist.all_gather_single(out, front, group=c.pg)
    pieces = out.chunk(c.n, 0)  # in torch's (rank) order
    ordered = [None] * c.n
    for slot, member in enumerate(c.to_torch):
        ordered[member] = pieces[slot]
    c.note(Kind.ALL_GATHER, (c.n - 1) * x.numel() * x.element_size(), backward, x.dtype)
    return torch.cat(ordered, 0).movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, dim: int, c: _Ctx, backward: bool) -> torch.Tensor:
    pieces = x.movedim(dim, 0).chunk(c.n, 0)  # in plan order
    inp = torch.cat([pieces[m] for m in c.to_torch], 0).contiguous()
    out = torch.empty((inp.shape[0] // c.n,) + inp.shape[1:], dtype=x.dtype, device=x.device)
    dist.reduce_scatter_single(out, inp, group=c.pg)
    c.note(Kind.REDUCE_SCATTER, (c.n - 1) * x.numel() // c.n * x.element_size(), backward, x.dtype)
    return out.movedim(0, dim)


def _all_to_all(x: torch.Tensor, split: int, concat: int, c: _Ctx, backward: bool) -> torch.Tensor:
    pieces = x.chunk(c.n, split)  # piece k goes to member k
    inp = torch.stack([pieces[m] for m in c.to_torch]).contiguous()
    out = torch.empty_like(inp)
    dist.all_to_all_single(out, inp, group=c.pg)
    got = [None] * c.n
    for slot, member in enumerate(c.to_torch):
        got[member] = out[slot]
    c.note(Kind.ALL_TO_ALL, (c.n - 1) * x.numel() // c.n * x.element_size(), backward, x.dtype)
    return torch.cat(got, concat)


def _all_reduce(x: torch.Tensor, c: _Ctx, backward: bool, op=dist.ReduceOp.SUM) -> torch.Tensor:
    out = x.contiguous().clone()
    dist.all_reduce(out, op=op, group=c.pg)
    c.note(Kind.ALL_REDUCE, 2 * (c.n - 1) * x.numel() // c.n * x.element_size(), backward, x.dtype)
    return out


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, c):
        ctx.dim, ctx.c = dim, c
        return _gather(x, dim, c, False)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter(g, ctx.dim, ctx.c, True), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, c):
        ctx.dim, ctx.c = dim, c
        return _reduce_scatter(x, dim, c, False)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, ctx.dim, ctx.c, True), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, split, concat, c):
        ctx.split, ctx.concat, ctx.c = split, concat, c
        return _all_to_all(x, split, concat, c, False)

    @staticmethod
    def backward(ctx, g):
        return _all_to_all(g, ctx.concat, ctx.split, ctx.c, True), None, None, None


class _AllReduce(torch.autograd.Function):
    """Sums pending partials; the result is the same on every member, and so is its cotangent."""

    @staticmethod
    def forward(ctx, x, c):
        return _all_reduce(x, c, False)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _Vary(torch.autograd.Function):
    """A replicated value used where values vary over the group: its gradient is partial."""

    @staticmethod
    def forward(ctx, x, c):
        ctx.c = c
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.c, True), None


class _LocalSlice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, c):
        ctx.dim, ctx.c, ctx.shape = dim, c, x.shape
        return x.chunk(c.n, dim)[c.index].clone()

    @staticmethod
    def backward(ctx, g):
        # The input varies over the group (the executor varied it if it was shared): each rank's
        # gradient is its own piece, zeros elsewhere; no communication.
        out = g.new_zeros(ctx.shape)
        out.narrow(ctx.dim, ctx.c.index * g.shape[ctx.dim], g.shape[ctx.dim]).copy_(g)
        return out, None, None


class _SharedSlice(torch.autograd.Function):
    """A slice of a value every member holds alike: its gradient gathers every member's piece."""

    @staticmethod
    def forward(ctx, x, dim, c):
        ctx.dim, ctx.c = dim, c
        return x.chunk(c.n, dim)[c.index].clone()

    @staticmethod
    def backward(ctx, g):
        return _gather(g, ctx.dim, ctx.c, True), None, None


def slice_shared(step: LocalSlice, x: torch.Tensor, tm: TorchMesh, plan_mesh, log: CollectiveLog | None):
    return _SharedSlice.apply(x, step.dim, _Ctx(tm, step.axes, plan_mesh, log))


def _permute(x: torch.Tensor, pairs, rank: int) -> torch.Tensor:
    ops, out = [], x
    recv_from = [s for s, d in pairs if d == rank]
    for s, d in pairs:
        if s == rank:
            ops.append(dist.P2POp(dist.isend, x.contiguous(), d))
    if recv_from:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        ops.append(dist.P2POp(dist.irecv, out, recv_from[0]))
    for req in dist.batch_isend_irecv(ops) if ops else []:
        req.wait()
    return out


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pairs, rank, log):
        ctx.pairs, ctx.rank, ctx.log = pairs, rank, log
        if log is not None:
            log.record(Kind.PERMUTE, (), x.numel() * x.element_size() if any(s == rank for s, _ in pairs) else 0)
        return _permute(x, pairs, rank)

    @staticmethod
    def backward(ctx, g):
        # A shard that moved sends its gradient back; a shard that stayed keeps it; a rank whose
        # shard left and that received another one gets its own gradient from the receiver.
        back = tuple((d, s) for s, d in ctx.pairs)
        sent = any(s == ctx.rank for s, _ in ctx.pairs)
        received = any(d == ctx.rank for _, d in ctx.pairs)
        moved = _permute(g, back, ctx.rank)
        if sent and not received:
            moved = moved + g  # kept its own shard and also sent it: both uses contribute
        elif received and not sent:
            moved = torch.zeros_like(g)  # its shard was overwritten and went nowhere
        if ctx.log is not None:
            ctx.log.record(Kind.PERMUTE, (), g.numel() * g.element_size() if received else 0, True)
        return moved, None, None, None


def run_step(step: Step, x: torch.Tensor, tm: TorchMesh, plan_mesh, log: CollectiveLog | None) -> torch.Tensor:
    if isinstance(step, Permute):
        return _Permute.apply(x, step.pairs, tm.rank, log)
    c = _Ctx(tm, step.axes, plan_mesh, log)
    if isinstance(step, AllGather):
        return _AllGather.apply(x, step.dim, c)
    if isinstance(step, ReduceScatter):
        return _ReduceScatter.apply(x, step.dim, c)
    if isinstance(step, AllReduce):
        return _AllReduce.apply(x, c)
    if isinstance(step, AllToAll):
        return _AllToAll.apply(x, step.split_dim, step.concat_dim, c)
    if isinstance(step, LocalSlice):
        return _LocalSlice.apply(x, step.dim, c)
    raise TypeError(f"{step!r} is not a plan step")


def run_plan(plan: Plan, x: torch.Tensor, tm: TorchMesh, log: CollectiveLog | None = None) -> torch.Tensor:
    for step in plan.steps:
        x = run_step(step, x, tm, plan.mesh, log)
    return x


def vary(x: torch.Tensor, axes, tm: TorchMesh, log: CollectiveLog | None = None) -> torch.Tensor:
    return _Vary.apply(x, _Ctx(tm, tuple(axes), None, log, Source.OP)) if axes else x


def all_reduce(x: torch.Tensor, axes, tm: TorchMesh, log: CollectiveLog | None = None) -> torch.Tensor:
    """Sum over ``axes`` (norm statistics, the vocabulary-parallel loss); backward identity."""
    return _AllReduce.apply(x, _Ctx(tm, tuple(axes), None, log, Source.OP)) if axes else x


def all_max(x: torch.Tensor, axes, tm: TorchMesh, log: CollectiveLog | None = None) -> torch.Tensor:
    """The max over ``axes``, outside autograd (a shift that cancels in the loss); logged as the
    all-reduce it is (an all-reduce with max moves the bytes of one with sum)."""
    if not axes:
        return x.detach().clone()
    return _all_reduce(x.detach(), _Ctx(tm, tuple(axes), None, log, Source.OP), False, dist.ReduceOp.MAX)


class _CoalescedAllGather(torch.autograd.Function):
    """Several all-gathers over one group as one collective (FSDP's flat parameter): each rank's
    shards are flattened into one buffer, gathered once, and cut back into tensors. Backward: one
    reduce-scatter of the flattened gradients."""

    @staticmethod
    def forward(ctx, c, dims, *xs):
        ctx.c, ctx.dims, ctx.shapes = c, dims, [x.shape for x in xs]
        flat = torch.cat([x.reshape(-1) for x in xs])
        out = torch.empty(c.n * flat.numel(), dtype=flat.dtype, device=flat.device)
        dist.all_gather_single(out, flat, group=c.pg)
        c.note(Kind.ALL_GATHER, (c.n - 1) * flat.numel() * flat.element_size(), False, flat.dtype)
        rows = [None] * c.n
        for slot, member in enumerate(c.to_torch):
            rows[member] = out[slot * flat.numel():(slot + 1) * flat.numel()]
        outs, off = [], 0
        for x, d in zip(xs, dims):
            n = x.numel()
            outs.append(torch.cat([r[off:off + n].view(x.shape) for r in rows], d))
            off += n
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        c = ctx.c
        per_member = [[] for _ in range(c.n)]
        for g, d in zip(grads, ctx.dims):
            for m, piece in enumerate(g.chunk(c.n, d)):
                per_member[m].append(piece.reshape(-1))
        inp = torch.cat([torch.cat(per_member[m]) for m in c.to_torch]).contiguous()
        out = torch.empty(inp.numel() // c.n, dtype=inp.dtype, device=inp.device)
        dist.reduce_scatter_single(out, inp, group=c.pg)
        c.note(Kind.REDUCE_SCATTER, (c.n - 1) * out.numel() * out.element_size(), True, out.dtype)
        local, off = [], 0
        for shape in ctx.shapes:
            n = int(torch.Size(shape).numel())
            local.append(out[off:off + n].view(shape))
            off += n
        return (None, None, *local)


def all_gather_many(xs, dims, axes, tm: TorchMesh, plan_mesh=None, log: CollectiveLog | None = None):
    """All-gather each ``xs[i]`` along ``dims[i]`` over ``axes``, as one collective."""
    return _CoalescedAllGather.apply(_Ctx(tm, tuple(axes), plan_mesh, log), tuple(dims), *xs)
