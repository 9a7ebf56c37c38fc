"""The torch backend's pieces of a pipeline (``core.pipeline``): a ``StageRunner`` for this rank's
stages and a ``Transport`` of batched point-to-point ops to the neighbouring pp ranks. The session
(``session.TorchSession``) holds the parameters and drives ``run_pipeline`` with them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from ...core.executor import Sharded
from ...core.log import Source
from ...core.remat import run_layers
from ...core.schedule import Op
from ...core.steps import Kind
from ...core.session import make_executor, scalar_loss, sharded_inputs
from ...core.strategies import Role
from .comm import TorchComm
from .launch import mark_progress
from .remat import torch_checkpoint

if TYPE_CHECKING:
    from .session import TorchSession

__all__ = ["TorchStages", "P2P"]


class TorchStages:
    """``core.pipeline.StageRunner`` on this rank: a stage's forward through the core executor on
    the rank's parameter blocks (the collectives stay within the rank's pp slice: no layout uses
    the pp axis), its backward by autograd seeded with the gradient that came back (or 1/m at
    the loss); I is the gradient to the stage's input alone (the graph kept for W), W to its
    parameters alone (the bucketed gradient sums then finish)."""

    def __init__(self, session: "TorchSession", parts, *, training: bool = True):
        self.s, self.parts, self.training = session, parts, training
        self.p, self.pipe = session.program.micro, session.program.pipeline
        shape, dims = self.p.model.residual(self.p.batch)
        self.x_shape, self.x_layout = tuple(shape), self.p.activation(dims, shape)
        self.x_dims = dims
        self.weight_passes: dict = {}  # a stage's parameter names -> weight-gradient passes left this step

    def forward(self, stage: int, mb: int, x):
        s, p, model = self.s, self.p, self.p.model
        arrays, rows = self.parts[mb]
        names = self.pipe.params_of_stage[stage]
        lay = p.layouts[Role.PARAMS]
        # In the declared order, the same on every rank (a set's order is not: FSDP's fused gather
        # lays the parameters out in this order)
        sp = {k: Sharded(s.local[k], lay[k], d, frozenset(lay[k].spec.axes), k) for k, d in p.shapes.items()
              if k in names}
        comm = TorchComm(s.tm, s.local_ops, log=s.log, grad_sync=s.grad_sync)
        ops = make_executor(p, comm, sp, coalesce=s.coalesce, training=self.training, step=s.count, seed=s.seed,
                            rows=rows)
        place = lambda a, layout: torch.as_tensor(np.ascontiguousarray(a[layout.shard_slices(a.shape)[s.rank]]),
                                                  device=s.device)
        leaf = None
        if stage == 0:
            h = model.embed(ops, sp, sharded_inputs(p, arrays, place))
        else:
            leaf = x.detach().requires_grad_(True)
            h = Sharded(leaf, self.x_layout, self.x_shape, frozenset(self.x_layout.spec.axes))
        h = run_layers(model, p.remat, ops, sp, self.pipe.layers_of_stage[stage], h,
                       torch_checkpoint(p.remat) if self.training else None)
        if stage == self.pipe.stages - 1:
            loss = scalar_loss(ops, model.head(ops, sp, h, sharded_inputs(p, arrays, place)))
            return float(loss.detach()), (loss, leaf, names)
        y = ops.constrain(h, self.x_dims).local
        return y.detach().contiguous(), (y, leaf, names)

    def backward(self, ctx, dy, part):
        out, leaf, names = ctx
        s = self.s
        seed = torch.full_like(out, 1.0 / len(self.parts)) if dy is None else dy
        wrt = [leaf] if leaf is not None and part is not Op.W else []
        if part is not Op.I:
            wrt += [s.local[k] for k in sorted(names)]
        if wrt:
            mark_progress()
            if s.grad_sync is not None and part is not Op.I:
                # the stage's gradient sums wait for its last backward of the step
                self.weight_passes[ctx[2]] = left = self.weight_passes.get(ctx[2], len(self.parts)) - 1
                s.grad_sync.defer = left > 0
            torch.autograd.backward(out, seed, inputs=wrt, retain_graph=part is Op.I)
            if s.grad_sync is not None and part is not Op.I:
                s.grad_sync.finish()
        if leaf is None or part is Op.W:
            return None
        dx, leaf.grad = leaf.grad, None
        return dx.contiguous()


class P2P:
    """``core.pipeline.Transport`` over torch.distributed: a batch of point-to-point ops with the
    rank of the same coordinates on the neighbouring pp rank; sends are waited for at the end."""

    def __init__(self, session: "TorchSession"):
        self.s = session
        self.axis = session.program.pipeline.axis
        micro = session.program.micro
        shape, dims = micro.model.residual(micro.batch)
        self.local_shape = micro.activation(dims, shape).local_shape(tuple(shape))
        self.pending: list = []
        sched = session.program.pipeline.schedule
        if session.device.type == "cuda" and not sched.fifo_ordered():
            raise ValueError(f"the {sched.name} schedule (p={sched.ranks}, m={sched.microbatches}) sends two values "
                             f"between a pair of ranks in another order than they are received; NCCL matches "
                             f"point-to-point ops by order, not tag. Choose another microbatch count or schedule.")

    def _peer(self, pp_rank: int) -> int:
        mesh = self.s.program.mesh
        return mesh.rank({**mesh.coords(self.s.rank), self.axis: pp_rank})

    def exchange(self, rank, sends, recvs) -> dict:
        import torch.distributed as dist

        ops, bufs = [], {}
        for key, peer, value in sends:
            ops.append(dist.P2POp(dist.isend, value, self._peer(peer), tag=self._tag(key)))
            self.s.log.record(Kind.PERMUTE, (self.axis,), value.numel() * value.element_size(), key[0] == "B",
                              Source.P2P, value.dtype, f"pp stage {key[1] + (1 if key[0] == 'B' else -1)}")
        for key, peer in recvs:
            # NaN until the value arrives: a value read before then poisons the loss, never hides
            bufs[key] = torch.full(self.local_shape, float("nan"), device=self.s.device,
                                   dtype=getattr(torch, self.s.program.precision.compute))  # what the stages send
            ops.append(dist.P2POp(dist.irecv, bufs[key], self._peer(peer), tag=self._tag(key)))
        if not ops:
            return {}
        mark_progress()
        works = dist.batch_isend_irecv(ops)
        for work in works[len(sends):]:
            work.wait()
        self.pending += [(w, v) for w, (_, _, v) in zip(works[:len(sends)], sends)]
        return bufs

    def _tag(self, key) -> int:
        # Each value its own tag: gloo matches a receive to the send with its tag, whatever order
        # the two ranks post them in (NCCL ignores tags: there the order must agree, see __init__).
        kind, stage, mb = key
        return (stage * self.s.program.pipeline.microbatches + mb) * 2 + (kind == "B")

    def finish(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()
