"""The numpy backend's ``Session``: a whole program on a simulated mesh in this process.

Sharded: every rank's blocks at once (``PerRank``), the core executor over ``NumpyComm``, the
backward by ``autodiff`` with the collectives' transposes; each gradient is assembled from the
ranks' blocks with ``core.sim.gather``, which refuses replicas that differ (a variance bug shows
up as that, before any comparison with a reference). Single: the same ops on whole arrays. The
optimizer is ``core.optim.adamw_update`` on global arrays.
"""

from __future__ import annotations

from typing import Callable, Mapping

import numpy as np

from ...core.ops import DenseOps, DropoutKey
from ...core.optim import AdamState, adamw_update
from ...core.pieces import owned_blocks, pieces_of, rank_file
from ...core.executor import Sharded
from ...core.pipeline import Mailbox, run_pipeline
from ...core.program import Program
from ...core.schedule import Op
from ...core.session import check_batch, make_executor, microbatches, scalar_loss, sharded_inputs, sharded_params
from ...core.sim import gather, scatter
from ...core.spec import Layout
from ...core.strategies import Role
from ...core.trace import Recorder, assemble, check_step
from . import autodiff as ad
from .comm import NumpyComm
from .ops import NumpyLocal, PerRank

__all__ = ["NumpyBackend", "NumpySession"]

MAX_RANKS = 64


class NumpyBackend:
    def __init__(self, name: str = "numpy", single: bool = False):
        self.name, self.single = name, single

    def prepare(self, mesh) -> None:
        if not self.single and mesh.size > MAX_RANKS:
            raise ValueError(f"{mesh} has {mesh.size} ranks; the numpy backend simulates at most {MAX_RANKS} in one "
                             f"process.")

    def run(self, program: Program, fn: Callable, *args, params=None, seed: int = 0, on_event=None,
            timeout_s: float = 600.0):
        self.prepare(program.mesh)
        session = NumpySession(program, program.init(seed) if params is None else params, single=self.single,
                               emit=on_event, seed=seed)
        return fn(session, *args)


class NumpySession:
    rank, lead = 0, True

    def __init__(self, program: Program, params: Mapping[str, np.ndarray], *, single: bool = False,
                 emit: Callable | None = None, seed: int = 0):
        if program.precision.mixed:
            raise ValueError(f"the numpy simulator computes in float32 only (numpy's einsum has no bfloat16); "
                             f"precision {program.precision.name!r} runs on torch and JAX: use --backends "
                             f"torch,jax,jax-gspmd (references torch-single, jax-single), or --precision fp32.")
        self.program, self.single, self.seed = program, single, seed
        self._params = {k: np.asarray(params[k], np.float32).copy() for k in program.shapes}
        self.opt = AdamState()
        self._emit = emit

    # -- one forward (and backward) ------------------------------------------------------------------
    def _forward(self, batch, *, training: bool, wrap=None, program: Program | None = None, rows=(1, 0)):
        """(loss value per rank or whole, leaves by parameter name) of one (micro)batch."""
        p = self.program if program is None else program
        model = p.model
        if self.single:
            leaves = {k: ad.Var(v) for k, v in self._params.items()}
            ops = DenseOps(NumpyLocal(), training=training, rng=DropoutKey(self.seed, self.opt.count, rows=rows))
            ops = wrap(ops) if wrap is not None else ops
            inputs = check_batch(p, batch)
            return [model.loss(ops, leaves, inputs)], {k: [v] for k, v in leaves.items()}, None
        comm = NumpyComm(p.mesh)
        leaves = {k: [ad.Var(b) for b in scatter(v, p.layouts[Role.PARAMS][k])] for k, v in self._params.items()}
        params = sharded_params(p, {k: PerRank(v) for k, v in leaves.items()})
        inputs = sharded_inputs(p, batch, lambda x, layout: PerRank(scatter(x, layout)))
        ops = make_executor(p, comm, params, training=training, step=self.opt.count, seed=self.seed, rows=rows)
        rec = wrap(ops) if wrap is not None else ops
        loss = scalar_loss(ops, model.loss(rec, params, inputs))
        return loss.values, leaves, ops

    def _grads(self, batch, *, training: bool = True):
        """The loss and global gradients of a step's batch: each microbatch's backward of its loss
        weighted 1/k (``core.session.microbatches``), the gradients summed; with a pipeline, the
        schedule's actions in order (``core.pipeline.run_pipeline``)."""
        if self.program.pipeline is not None and not self.single:
            return self._pipeline_grads(batch, training=training)
        parts = microbatches(self.program, batch)
        total, out = 0.0, {}
        for arrays, rows in parts:
            loss, grads = self._grads_of(arrays, training=training, rows=rows, weight=1.0 / len(parts))
            total += loss / len(parts)
            out = grads if not out else {k: out[k] + grads[k] for k in out}
        return total, out

    def _pipeline_grads(self, batch, *, training: bool):
        """Every pp rank's actions in this process, passing values through a ``Mailbox``. Each
        stage runs on the whole simulated mesh (nothing it computes varies over pp, so its pp
        replicas are equal): what this checks is the schedule's order, its stashes, the split of
        B into I and W, and the loss's normalisation, against the one-device run."""
        p = self.program
        leaves = {k: [ad.Var(b) for b in scatter(v, p.layouts[Role.PARAMS][k])] for k, v in self._params.items()}
        stages = _NumpyStages(self, microbatches(p, batch), leaves, training)
        losses = run_pipeline(p.pipeline, {r: stages for r in range(p.pipeline.ranks)}, Mailbox())
        out = {}
        for k, vs in leaves.items():
            blocks = [np.zeros_like(ad.value(v)) if g is None else g for v, g in zip(vs, stages.acc.get(k, [None] * len(vs)))]
            out[k] = _assemble(blocks, p.layouts[Role.PARAMS][k], k)
        last = p.pipeline.schedule.rank_of(p.pipeline.stages - 1)
        return float(np.mean(losses[last], dtype=np.float64)), out

    def _grads_of(self, batch, *, training: bool, rows, weight: float):
        outs, leaves, _ = self._forward(batch, training=training, program=self.program.micro, rows=rows)
        flat = [v for k in leaves for v in leaves[k]]
        seeds = None if weight == 1.0 else [np.full_like(ad.value(o), weight) for o in outs]
        grads = ad.grad(outs, flat, seeds)
        out, i = {}, 0
        for k, vs in leaves.items():
            blocks = [np.zeros_like(ad.value(v)) if g is None else g for v, g in zip(vs, grads[i:i + len(vs)])]
            i += len(vs)
            out[k] = blocks[0] if self.single else _assemble(blocks, self.program.layouts[Role.PARAMS][k], k)
        return float(ad.value(outs[0])), out

    # -- the Session contract ---------------------------------------------------------------------------
    def step(self, batch) -> float:
        loss, grads = self._grads(batch)
        self._params = adamw_update(self._params, grads, self.opt, self.program.optimizer)
        return loss

    def eval_loss(self, batch) -> float:
        outs, _, _ = self._forward(batch, training=False)
        return float(ad.value(outs[0]))

    def loss_and_grads(self, batch):
        return self._grads(batch)

    def params(self) -> dict[str, np.ndarray]:
        return {k: v.copy() for k, v in self._params.items()}

    def checkpoint_tensors(self):
        p = self.program
        named = [(f"params/{k}", v, p.layouts[Role.PARAMS][k]) for k, v in self._params.items()]
        for kind, store in (("mu", self.opt.mu), ("nu", self.opt.nu)):
            named += [(f"opt/{kind}/{k}", store.get(k, np.zeros_like(v)), p.layouts[Role.OPTIMIZER][k])
                      for k, v in self._params.items()]
        tensors, blocks = [], {}
        for name, value, layout in named:
            tensors.append((name, value.shape, str(layout), pieces_of(name, layout, value.shape)))
            for r, sl in enumerate(layout.shard_slices(value.shape)):
                for piece in owned_blocks(name, layout, value.shape, r):
                    blocks.setdefault(rank_file(r), {})[piece.key] = np.ascontiguousarray(value[sl])
        return tensors, blocks, self.opt.count

    def restore(self, ckpt, params_only: bool = False) -> None:
        shapes = self.program.shapes
        self._params = {k: ckpt.read(f"params/{k}", shape=s) for k, s in shapes.items()}
        self.opt = AdamState()
        if not params_only:
            self.opt.count = ckpt.count()
            self.opt.mu = {k: ckpt.read(f"opt/mu/{k}", shape=s) for k, s in shapes.items()}
            self.opt.nu = {k: ckpt.read(f"opt/nu/{k}", shape=s) for k, s in shapes.items()}

    def trace(self, batch) -> list:
        world = 1 if self.single else self.program.mesh.size
        holder = {}

        def capture(probe, out):
            if self.single:
                probe.value = np.asarray(ad.value(out))
                return
            probe.layout = out.layout
            probe.pieces = {r: np.asarray(ad.value(v)) for r, v in enumerate(out.local.values)}
            assemble(probe, world)

        def on_step(probe, plan, i, before, after):
            probe.steps.append(check_step(plan, i, [ad.value(v) for v in before.values],
                                          [ad.value(v) for v in after.values]))

        def wrap(ops):
            holder["rec"] = Recorder(ops, capture, None if self.single else on_step)
            return holder["rec"]

        self._forward(batch, training=False, wrap=wrap)
        return holder["rec"].probes + holder["rec"].outside

    def barrier(self) -> None:
        pass

    def emit(self, event) -> None:
        if self._emit is not None:
            self._emit(event)


class _NumpyStages:
    """``core.pipeline.StageRunner`` on the numpy simulator: a stage's forward on every simulated
    rank with fresh leaves for its input, its backward by ``autodiff`` seeded with the gradient
    that came back (or 1/m at the loss), the parameters' gradients summed over microbatches."""

    def __init__(self, session: NumpySession, parts, leaves, training: bool):
        self.s, self.parts, self.leaves, self.training = session, parts, leaves, training
        self.p = session.program.micro
        self.pipe = session.program.pipeline
        self.acc: dict[str, list] = {}
        shape, self.x_dims = self.p.model.residual(self.p.batch)  # the value between stages
        self.x_shape, self.x_layout = tuple(shape), self.p.activation(self.x_dims, shape)

    def forward(self, stage: int, mb: int, x):
        p, model = self.p, self.p.model
        arrays, rows = self.parts[mb]
        params = sharded_params(p, {k: PerRank(v) for k, v in self.leaves.items()})
        ops = make_executor(p, NumpyComm(p.mesh), params, training=self.training, step=self.s.opt.count,
                            seed=self.s.seed, rows=rows)
        place = lambda a, layout: PerRank(scatter(a, layout))
        x_leaves = None
        if stage == 0:
            x = model.embed(ops, params, sharded_inputs(p, arrays, place))
        else:
            x_leaves = [ad.Var(v) for v in x.local.values]
            x = Sharded(PerRank(x_leaves), x.layout, x.shape, x.varying)
        for i in self.pipe.layers_of_stage[stage]:
            x = model.layer(ops, params, i, x)
        names = self.pipe.params_of_stage[stage]
        if stage == self.pipe.stages - 1:
            loss = scalar_loss(ops, model.head(ops, params, x, sharded_inputs(p, arrays, place)))
            return float(ad.value(loss.values[0])), (loss.values, x_leaves, names, None)
        y = ops.constrain(x, self.x_dims)
        sent = Sharded(PerRank([ad.value(v) for v in y.local.values]), y.layout, y.shape, y.varying)
        return sent, (y.local.values, x_leaves, names, y)

    def backward(self, ctx, dy, part):
        outs, x_leaves, names, y = ctx
        m = len(self.parts)
        seeds = [np.full_like(ad.value(o), 1.0 / m) for o in outs] if dy is None else list(dy.local.values)
        wrt = list(x_leaves) if part is not Op.W and x_leaves is not None else []
        n_x = len(wrt)
        if part is not Op.I:
            order = sorted(names)
            for k in order:
                wrt += self.leaves[k]
        grads = ad.grad(outs, wrt, seeds)
        if part is not Op.I:
            i = n_x
            for k in order:
                n = len(self.leaves[k])
                acc = self.acc.setdefault(k, [None] * n)
                for r, g in enumerate(grads[i:i + n]):
                    if g is not None:
                        acc[r] = g if acc[r] is None else acc[r] + g
                i += n
        if not n_x:
            return None
        dx = [np.zeros_like(ad.value(v)) if g is None else g for v, g in zip(x_leaves, grads[:n_x])]
        return Sharded(PerRank(dx), self.x_layout, self.x_shape, frozenset(self.x_layout.spec.axes))


def _assemble(blocks, layout: Layout, name: str) -> np.ndarray:
    try:
        return gather(blocks, layout)
    except ValueError as e:
        raise AssertionError(f"the gradient of {name!r} differs between ranks that hold the same block of {layout}: "
                             f"the executor's variance rule did not sum it where the parameter stops varying ({e})"
                             ) from None
