"""The JAX backend under a pipeline: each pp rank's slice of the devices is a sub-mesh, each stage
a jitted ``shard_map`` of the core executor on it (explicit mode; under GSPMD, a jitted function
of global arrays with the layouts as shardings), and ``core.pipeline.run_pipeline`` drives every
pp rank's actions from this one process (MPMD, as JaxPP does), passing values between sub-meshes
with ``jax.device_put``.

A forward keeps only the stage's input (and its microbatch's index); a backward recomputes the
stage under ``jax.vjp`` and pulls the output gradient through it: to the stage's input and its
parameters (B), to the input alone (I) or to the parameters alone (W). What is alive on a
sub-mesh at any time is what the schedule holds there: the stashed inputs of its in-flight
microbatches, the parameters, their gradients and the optimizer states of its stages.

The update: gradients of a parameter that stages on several pp ranks use (a tied table) are
summed over those ranks, the global norm is summed over every pp rank (each parameter counted
once) and clips every gradient, and AdamW (optax, the same rule as the other modes) steps each pp
rank's parameters on its sub-mesh.
"""

from __future__ import annotations

import functools
from typing import Callable, Mapping

import jax
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from ...core.executor import Sharded
from ...core.log import CollectiveLog
from ...core.mesh import Mesh
from ...core.ops import DenseOps, DropoutKey, step_words
from ...core.pieces import owned_blocks, pieces_of, rank_file
from ...core.pipeline import Mailbox, run_pipeline
from ...core.program import Program, make_program
from ...core.remat import run_layers
from ...core.schedule import Op
from ...core.session import input_values, microbatches, scalar_loss
from ...core.strategies import Role
from .comm import JaxComm
from .distributed import fetch, put
from .mesh import AtomMesh, lower_layout, lower_mesh
from .ops import JaxLocal
from .remat import jax_checkpoint

__all__ = ["JaxPipelineSession", "PipelinedSession", "pipeline_checkpoint", "stage_program"]


def stage_program(program: Program) -> Program:
    """One pp rank's program of one microbatch: the mesh with the pp axis of size 1 (the same layouts
    over the other axes, on that rank's devices)."""
    pp = program.pipeline.axis
    mesh = Mesh(**{a: (1 if a == pp else n) for a, n in program.mesh.axes})
    return make_program(program.model, program.strategy, mesh, batch=program.batch // program.microbatches,
                        optimizer=program.optimizer, remat=program.remat, precision=program.precision,
                        offload=program.offload, _stage=True)


class PipelinedSession:
    """What both JAX pipeline sessions (this module's and the tick loop's) do alike."""

    rank, lead = 0, True
    _emit = None

    def trace(self, batch) -> list:
        raise ValueError("the bisect records one forward of the whole model; under a pipeline each pp rank runs its own "
                         "stages, which it does not follow yet. Bisect the same strategy without pp.")

    def barrier(self) -> None:
        pass

    def emit(self, event) -> None:
        if self._emit is not None:
            self._emit(event)


class JaxPipelineSession(PipelinedSession):

    def __init__(self, program: Program, params: Mapping[str, np.ndarray], *, seed: int = 0,
                 emit: Callable | None = None, devices=None, gspmd: bool = False):
        self.program, self.seed, self._emit, self.gspmd = program, seed, emit, gspmd
        self.pipe = pipe = program.pipeline
        mesh = program.mesh
        self.log = CollectiveLog()
        self.sub = stage_program(program)
        grid = np.array(list(devices or jax.devices())[:mesh.size], dtype=object).reshape(mesh.sizes)
        axis = mesh.axis_names.index(pipe.axis)
        self.atoms = AtomMesh(self.sub.mesh)
        slices = [list(np.take(grid, [r], axis=axis).reshape(-1)) for r in range(pipe.ranks)]
        self.meshes = [lower_mesh(self.sub.mesh, d, axis_type=AxisType.Auto) if gspmd else self.atoms.jax_mesh(d)
                       for d in slices]
        self.tx = optax.chain(optax.scale_by_adam(b1=program.optimizer.beta1, b2=program.optimizer.beta2,
                                                  eps=program.optimizer.eps),
                              optax.add_decayed_weights(program.optimizer.weight_decay))
        self.count = 0
        shape, dims = program.model.residual(self.sub.batch)
        self.x_shape, self.x_dims = tuple(shape), dims
        self.x_layout = self.sub.activation(dims, shape)
        self._place_params(params)
        self._fns: dict = {}
        # Set to a list to record, after every compute action, (pp rank, action, bytes of the live
        # arrays on that rank's devices): benchmarks/pipeline_memory.py reads it.
        self.memory_trace: list | None = None

    def live_bytes(self, r: int) -> int:
        """Bytes of every live array on pp rank r's devices (each shard counted once)."""
        devices = set(self.meshes[r].devices.flat)
        return sum(shard.data.nbytes for a in jax.live_arrays() for shard in a.addressable_shards
                   if shard.device in devices)

    # -- placement -------------------------------------------------------------------------------------
    def _sharding(self, r: int, layout) -> NamedSharding:
        if self.gspmd:
            return lower_layout(layout, self.meshes[r])
        return NamedSharding(self.meshes[r], self.atoms.spec(layout))

    def _held(self, r: int) -> list[str]:
        """pp rank r's parameters, in the declared order."""
        mine = self.pipe.params_of_rank(r)
        return [k for k in self.program.shapes if k in mine]

    def _place_params(self, params) -> None:
        lay = self.sub.layouts
        self.pvals = [{k: put(np.asarray(params[k], np.float32), self._sharding(r, lay[Role.PARAMS][k]))
                        for k in self._held(r)} for r in range(self.pipe.ranks)]
        self.opt = [jax.jit(self.tx.init)(p) for p in self.pvals]

    def _opt_state(self, r: int, count: int, mu, nu):
        """pp rank r's AdamW state after ``count`` updates with moments ``mu``, ``nu`` (global arrays)."""
        lay = self.sub.layouts[Role.OPTIMIZER]
        adam, rest = self.opt[r]
        placed = lambda store: {k: put(np.asarray(store[k], np.float32), self._sharding(r, lay[k])) for k in self._held(r)}
        # Adam's int32 count only sets the bias corrections (1 in fp32 long before it saturates)
        steps = jax.numpy.asarray(min(count, np.iinfo(np.int32).max), adam.count.dtype)
        return (adam._replace(count=steps, mu=placed(mu), nu=placed(nu)), rest)

    # -- one stage, jitted ---------------------------------------------------------------------------------
    def _stage_fn(self, r: int, stage: int, training: bool):
        """f(params of the stage, x, inputs, step words, rows) -> the stage's output (or the loss)."""
        sub, atoms, pipe, model = self.sub, self.atoms, self.pipe, self.program.model
        names = [k for k in self._held(r) if k in pipe.params_of_stage[stage]]
        last = stage == pipe.stages - 1
        lay = sub.layouts[Role.PARAMS]
        if self.gspmd:
            return names, self._gspmd_stage_fn(r, stage, training, names)

        def local(params, x, batch, step, rows):
            comm = JaxComm(atoms, self.log)
            sp = {k: Sharded(params[k], lay[k], sub.shapes[k], frozenset(lay[k].spec.axes), k) for k in names}
            from ...core.session import make_executor

            ops = make_executor(sub, comm, sp, coalesce=False, training=training, step=step, seed=self.seed,
                                rows=(rows[0], rows[1]))
            if stage == 0:
                h = model.embed(ops, sp, input_values(sub, batch))
            else:
                h = Sharded(x, self.x_layout, self.x_shape, frozenset(self.x_layout.spec.axes))
            h = run_layers(model, self.program.remat, ops, sp, pipe.layers_of_stage[stage], h,
                           jax_checkpoint(self.program.remat) if training else None)
            if last:
                return scalar_loss(ops, model.head(ops, sp, h, input_values(sub, batch)))
            return ops.constrain(h, self.x_dims).local

        x_spec = atoms.spec(self.x_layout) if stage > 0 else PartitionSpec()
        in_specs = ({k: atoms.spec(lay[k]) for k in names}, x_spec,
                    {k: atoms.spec(sub.layouts[Role.ACTIVATIONS][k]) for k in sub.inputs}, PartitionSpec(),
                    PartitionSpec())
        out_spec = PartitionSpec() if last else atoms.spec(self.x_layout)
        return names, jax.shard_map(local, mesh=self.meshes[r], in_specs=in_specs, out_specs=out_spec)

    def _gspmd_stage_fn(self, r: int, stage: int, training: bool, names):
        """The stage on global arrays of pp rank r's sub-mesh: XLA chooses the collectives from the
        layouts (parameters where used, activations at the constraint points)."""
        sub, pipe, model, jmesh = self.sub, self.pipe, self.program.model, self.meshes[r]
        wsc = jax.lax.with_sharding_constraint

        def f(params, x, batch, step, rows):
            ops = DenseOps(JaxLocal(), constrain=lambda v, dims: wsc(v, lower_layout(sub.activation(dims, v.shape),
                                                                                     jmesh)),
                           param=lambda name, v, dims: wsc(v, lower_layout(sub.compute(name), jmesh)),
                           training=training, rng=DropoutKey(self.seed, step, rows=(rows[0], rows[1])),
                           dtype=sub.precision.dtype)
            h = model.embed(ops, params, batch) if stage == 0 else x
            h = run_layers(model, self.program.remat, ops, params, pipe.layers_of_stage[stage], h,
                           jax_checkpoint(self.program.remat) if training else None)
            if stage == pipe.stages - 1:
                return model.head(ops, params, h, batch)
            return ops.constrain(h, self.x_dims)
        return f

    def _fn(self, kind: str, r: int, stage: int, training: bool = True):
        key = (kind, r, stage, training)
        if key not in self._fns:
            names, f = self._stage_fn(r, stage, training)
            if kind == "F":
                fn = jax.jit(f)
            elif kind == "B":
                fn = jax.jit(lambda p, x, b, s, rows, dy: jax.vjp(lambda p, x: f(p, x, b, s, rows), p, x)[1](dy))
            elif kind == "I":
                fn = jax.jit(lambda p, x, b, s, rows, dy: jax.vjp(lambda x: f(p, x, b, s, rows), x)[1](dy)[0])
            else:  # W
                fn = jax.jit(lambda p, x, b, s, rows, dy: jax.vjp(lambda p: f(p, x, b, s, rows), p)[1](dy)[0])
            self._fns[key] = (names, fn)
        return self._fns[key]

    def _to(self, r: int, x, layout=None):
        """``x`` on pp rank r's devices (a value that came from another pp rank)."""
        return jax.device_put(x, self._sharding(r, self.x_layout if layout is None else layout))

    # -- a step --------------------------------------------------------------------------------------------
    def _run(self, batch, *, training: bool = True):
        """(mean loss, per pp rank {name: gradient}) of a step's batch through the schedule."""
        parts = microbatches(self.program, batch)
        placed = {}
        runners = {r: _Stages(self, r, parts, placed, training) for r in range(self.pipe.ranks)}
        losses = run_pipeline(self.pipe, runners, Mailbox())
        last = self.pipe.schedule.rank_of(self.pipe.stages - 1)
        loss = float(np.mean(np.asarray(losses[last], np.float64)))
        grads = [runners[r].grads for r in range(self.pipe.ranks)]
        for k in self.pipe.shared_params:  # a tied table: the sum of its holders' gradients, on each of them
            holders = self.pipe.ranks_of_param(k)
            total = sum(fetch(grads[r][k]) for r in holders)
            for r in holders:
                grads[r][k] = put(total, self._sharding(r, self.sub.layouts[Role.PARAMS][k]))
        return loss, grads

    def step(self, batch) -> float:
        cfg = self.program.optimizer
        loss, grads = self._run(batch)
        # The global norm counts each parameter once (a tied table on its first holder only).
        sq = 0.0
        for r in range(self.pipe.ranks):
            mine = {k: g for k, g in grads[r].items() if self.pipe.rank_of_param(k) == r}
            sq += float(_sum_of_squares(mine)) if mine else 0.0
        norm = np.float32(np.sqrt(sq))
        scale = np.float32(1.0) if norm < cfg.clip else np.float32(cfg.clip) / norm
        lr = np.float32(cfg.lr_at(self.count))
        for r in range(self.pipe.ranks):
            self.pvals[r], self.opt[r] = self._update(self.pvals[r], self.opt[r], grads[r], scale, lr)
        self.count += 1
        return loss

    @functools.partial(jax.jit, static_argnums=0)
    def _update(self, params, opt, grads, scale, lr):
        grads = jax.tree.map(lambda g: g * scale, grads)
        updates, opt = self.tx.update(grads, opt, params)
        return jax.tree.map(lambda p, u: p - lr * u, params, updates), opt

    def eval_loss(self, batch) -> float:
        parts = microbatches(self.program, batch)
        total = 0.0
        for j, (arrays, rows) in enumerate(parts):
            x, placed = None, {}
            for s in range(self.pipe.stages):
                r = self.pipe.schedule.rank_of(s)
                names, f = self._fn("F", r, s, training=False)
                b = placed[r] = placed[r] if r in placed else self._batch(r, arrays)
                x = f({k: self.pvals[r][k] for k in names}, self._to(r, x) if s else np.float32(0), b,
                      step_words(self.count), np.asarray(rows, np.int32))
            total += float(x) / len(parts)
        return total

    def _batch(self, r: int, arrays):
        return {k: put(v, self._sharding(r, self.sub.layouts[Role.ACTIVATIONS][k])) for k, v in arrays.items()}

    def loss_and_grads(self, batch):
        loss, grads = self._run(batch)
        return loss, {k: fetch(grads[self.pipe.rank_of_param(k)][k]) for k in self.program.shapes}

    def params(self) -> dict[str, np.ndarray]:
        return {k: fetch(self.pvals[self.pipe.rank_of_param(k)][k]) for k in self.program.shapes}

    def _moments(self):
        mu, nu = {}, {}
        for r in range(self.pipe.ranks):
            adam = self.opt[r][0]
            for k in self._held(r):
                if self.pipe.rank_of_param(k) == r:
                    mu[k], nu[k] = fetch(adam.mu[k]), fetch(adam.nu[k])
        return mu, nu

    def checkpoint_tensors(self):
        values = {f"params/{k}": v for k, v in self.params().items()}
        mu, nu = self._moments()
        values.update({f"opt/mu/{k}": v for k, v in mu.items()})
        values.update({f"opt/nu/{k}": v for k, v in nu.items()})
        return pipeline_checkpoint(self.program, values) + (self.count,)

    def restore(self, ckpt, params_only: bool = False) -> None:
        shapes = self.program.shapes
        params = {k: ckpt.read(f"params/{k}", shape=s) for k, s in shapes.items()}
        self._place_params(params)
        self.count = 0
        if not params_only:
            count = ckpt.count()
            mu = {k: ckpt.read(f"opt/mu/{k}", shape=s) for k, s in shapes.items()}
            nu = {k: ckpt.read(f"opt/nu/{k}", shape=s) for k, s in shapes.items()}
            self.opt = [self._opt_state(r, count, mu, nu) for r in range(self.pipe.ranks)]
            self.count = count



def pipeline_checkpoint(program: Program, values: Mapping[str, np.ndarray]) -> tuple[list, dict]:
    """(tensors, blocks) of a pipelined run's checkpoint from the global ``values`` of its params and
    moments: each parameter's blocks (and its moments') written by the ranks of its first pp holder."""
    lay, shapes, mesh, pipe = program.layouts, program.shapes, program.mesh, program.pipeline
    named = [(f"params/{k}", lay[Role.PARAMS][k]) for k in shapes]
    named += [(f"opt/{kind}/{k}", lay[Role.OPTIMIZER][k]) for k in shapes for kind in ("mu", "nu")]
    tensors, blocks = [], {}
    for name, layout in named:
        k = name.rsplit("/", 1)[1]
        holders = {r for r in range(mesh.size) if mesh.coord(r, pipe.axis) == pipe.rank_of_param(k)}
        tensors.append((name, tuple(shapes[k]), str(layout), pieces_of(name, layout, shapes[k], holders)))
        slices = layout.shard_slices(tuple(shapes[k]))
        for r in holders:
            for piece in owned_blocks(name, layout, shapes[k], r, holders):
                blocks.setdefault(rank_file(r), {})[piece.key] = np.ascontiguousarray(values[name][slices[r]])
    return tensors, blocks


@jax.jit
def _sum_of_squares(grads):
    return sum(jax.numpy.sum(jax.numpy.square(g)) for g in grads.values())


class _Stages:
    """``core.pipeline.StageRunner`` for pp rank r: F runs the stage and keeps its input; B, I and W
    recompute it under ``jax.vjp`` (the last stage seeded with 1/m) and add the parameters'
    gradients up over the step's microbatches."""

    def __init__(self, session: JaxPipelineSession, r: int, parts, placed: dict, training: bool):
        self.s, self.r, self.parts, self.placed, self.training = session, r, parts, placed, training
        self.grads: dict = {}

    def _inputs(self, mb: int):
        key = (self.r, mb)
        if key not in self.placed:
            self.placed[key] = self.s._batch(self.r, self.parts[mb][0])
        return self.placed[key]

    def _args(self, stage: int, mb: int, x):
        s = self.s
        x = s._to(self.r, x) if stage > 0 else np.float32(0)
        return x, self._inputs(mb), step_words(s.count), np.asarray(self.parts[mb][1], np.int32)

    def forward(self, stage: int, mb: int, x):
        s = self.s
        names, f = s._fn("F", self.r, stage, self.training)
        params = {k: s.pvals[self.r][k] for k in names}
        x, b, step, rows = self._args(stage, mb, x)
        y = f(params, x, b, step, rows)
        out = float(y) if stage == s.pipe.stages - 1 else y
        self._note(Op.F, stage, mb)
        return out, (stage, mb, x)

    def _note(self, op, stage, mb) -> None:
        if self.s.memory_trace is not None:
            jax.block_until_ready(jax.live_arrays())
            self.s.memory_trace.append((self.r, f"{stage}{op.value}{mb}", self.s.live_bytes(self.r)))

    def backward(self, ctx, dy, part):
        s = self.s
        stage, mb, x = ctx
        last = stage == s.pipe.stages - 1
        dy = np.float32(1.0 / len(self.parts)) if last else s._to(self.r, dy)
        kind = {Op.B: "B", Op.I: "I", Op.W: "W"}[part]
        if kind == "I" and stage == 0:
            self._note(part, stage, mb)
            return None  # the first stage has no input gradient to make
        names, fn = s._fn(kind, self.r, stage, self.training)
        params = {k: s.pvals[self.r][k] for k in names}
        out = fn(params, x, self._inputs(mb), step_words(s.count), np.asarray(self.parts[mb][1], np.int32), dy)
        if kind == "I":
            self._note(part, stage, mb)
            return out
        dparams, dx = (out, None) if kind == "W" else out
        for k, g in dparams.items():
            self.grads[k] = g if k not in self.grads else self.grads[k] + g
        self._note(part, stage, mb)
        return None if stage == 0 else dx
