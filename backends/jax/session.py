"""The JAX backend's ``Session``: one process, N devices, in one of three modes.

- *single*: one device, no sharding (the reference);
- *gspmd*: ``jit`` on global arrays; parameters, gradients and optimizer states get the program's
  layouts as ``NamedSharding``s, activations ``with_sharding_constraint`` at the constraint
  points, and XLA chooses the collectives;
- *explicit*: the whole forward inside ``shard_map`` on the core executor (``JaxComm``): every
  redistribution is a core plan on ``lax`` collectives; JAX differentiates it.

The optimizer (optax: global-norm clipping, AdamW, the schedule of ``OptimizerConfig``) runs under
``jit`` on the global arrays in every mode. The update count is a Python int on the host: the
step takes its learning rate and its dropout key (``step_words``) as arguments, so no int32
counter wraps or saturates after 2**31 updates.
"""

from __future__ import annotations

import enum
import functools
import warnings
from typing import Any, Callable, Mapping

import jax
import numpy as np
import optax
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from ...core import Layout
from ...core.log import CollectiveLog
from ...core.ops import DenseOps, DropoutKey, step_words
from ...core.optim import OptimizerConfig
from ...core.precision import LossScale
from ...core.pieces import Piece, box, piece_key, rank_file
from ...core.program import Program
from ...core.remat import remat_loss
from ...core.session import check_batch, in_order, input_values, make_executor, microbatches, scalar_loss, sharded_params
from ...core.strategies import Role
from ...core.trace import Recorder, assemble, check_step
from .comm import JaxComm, VarianceMismatch
from .jaxpr_traffic import BACKWARD
from .distributed import fetch, put
from .env import use_host_devices
from .mesh import AtomMesh, lower_layout, lower_mesh
from .ops import JaxLocal
from .remat import jax_checkpoint

__all__ = ["Mode", "JaxBackend", "JaxSession", "make_optimizer", "gspmd_ops", "checkpoint_pieces", "MAX_DEVICES"]

MAX_DEVICES = 64  # fake CPU devices this machine runs in reasonable time
HOST = "pinned_host"  # where --offload keeps AdamW's states (JAX's host memory kind; the CPU backend has it too)


class Mode(enum.Enum):
    SINGLE = "single"
    GSPMD = "gspmd"
    EXPLICIT = "explicit"


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    """optax.adamw without its learning rate: the step subtracts ``cfg.lr_at(count) * update``,
    the rate computed on the host as numpy and torch compute it (optax's schedule would count
    updates in int32). Adam's own int32 count only sets the bias corrections, which are 1 in
    float32 long before it saturates at 2**31 - 1."""
    return optax.chain(
        optax.clip_by_global_norm(cfg.clip),
        optax.scale_by_adam(b1=cfg.beta1, b2=cfg.beta2, eps=cfg.eps),
        optax.add_decayed_weights(cfg.weight_decay),
    )


def gradient_sums(program: Program) -> tuple[dict[str, tuple[str, ...]], list[str]]:
    """Each parameter whose gradient the executor sums over mesh axes it is replicated over
    (``vary``'s transpose: data parallelism's sum, or a tensor-parallel one of a replicated norm
    weight), by the one set of axes it sums over, read from ``program`` traced on shapes (the
    executor's own account); and the parameters it sums over two different sets (their sums stay
    where the executor runs them)."""
    from .memory import collective_traffic

    sets: dict[str, set] = {}
    for r in collective_traffic(program).entries:
        if r.backward and r.param:
            sets.setdefault(r.param, set()).add(frozenset(r.axes))
    once = {k: tuple(a for a in program.mesh.axis_names if a in next(iter(v))) for k, v in sets.items() if len(v) == 1}
    return once, sorted(k for k, v in sets.items() if len(v) > 1)


def gspmd_ops(program: Program, sharding: Callable[[Layout], NamedSharding], *, training: bool, rng: DropoutKey,
              dtype: str | None = None) -> DenseOps:
    """GSPMD mode's ``Ops``: whole arrays, a sharding constraint at each parameter's use (its
    compute layout) and at each constraint point (the activation layout of its dims)."""
    wsc = jax.lax.with_sharding_constraint
    constrain = lambda x, dims: wsc(x, sharding(program.activation(dims, x.shape)))
    param = lambda name, x, dims: wsc(x, sharding(program.compute(name)))
    return DenseOps(JaxLocal(), constrain=constrain, param=param, training=training, rng=rng, dtype=dtype)


def checkpoint_pieces(named, jax_mesh) -> tuple[list, dict]:
    """A checkpoint's tensors and this process's blocks from global arrays, each
    ``(name, array, layout)``: one piece per distinct block (replica 0, in the file of the mesh
    rank whose device holds it), from the arrays' own shards."""
    rank_of = {d.id: r for r, d in enumerate(jax_mesh.devices.flat)}
    tensors, blocks = [], {}
    for name, arr, layout in named:
        pieces: dict = {}
        for dev, index in arr.sharding.devices_indices_map(arr.shape).items():
            start, stop = b = box(index, arr.shape)
            if b not in pieces:
                pieces[b] = Piece(rank_file(rank_of[dev.id]), piece_key(name, start), start, stop)
        for shard in arr.addressable_shards:
            piece = pieces[box(shard.index, arr.shape)]
            if piece.file == rank_file(rank_of[shard.device.id]):
                blocks.setdefault(piece.file, {})[piece.key] = np.asarray(shard.data)
        tensors.append((name, tuple(arr.shape), str(layout), list(pieces.values())))
    return tensors, blocks


class JaxBackend:
    """``pipeline``: how explicit mode runs a pipelined program: ``loop`` (one compiled step, a
    tick loop inside ``shard_map``: backends/jax/ticks.py) or ``mpmd`` (a jitted program per stage
    driven from Python: backends/jax/pipeline.py, which GSPMD mode always uses)."""

    def __init__(self, name: str = "jax", mode: str = "explicit", pipeline: str = "loop"):
        self.name, self.mode, self.pipeline = name, Mode(mode), pipeline

    def activation_bytes(self, program: Program, backend: str = "torch") -> tuple[int, int, str]:
        """What one device of ``program`` keeps for its backward, traced on shapes (core/memory.py)."""
        from .memory import activation_bytes

        return activation_bytes(program, backend)

    def trace_step(self, program: Program) -> tuple[CollectiveLog, int, "Written"]:
        """What rank 0 sends in one forward and backward of ``program``, the FLOPs of its matrix
        products and the bytes its other ops write, traced on shapes (backends/jax/memory.py):
        no device, any mesh size."""
        from .memory import trace_step

        return trace_step(program)

    def trace_stage(self, program: Program, stage: int, part: str = "B") -> CollectiveLog:
        """What rank 0 sends in one microbatch of pipeline ``stage``, forward and backward (or
        a zero-bubble schedule's input or weight part of it), traced on shapes
        (backends/jax/memory.py)."""
        from .memory import trace_stage

        return trace_stage(program, stage, part)

    def check_plan(self, report):
        """``parlay plan --check``: the plan beside the compiled step (backends/jax/plan_check.py)."""
        from .plan_check import check_plan

        return check_plan(report)

    def prepare(self, mesh) -> None:
        n = 1 if self.mode is Mode.SINGLE else mesh.size
        if n > MAX_DEVICES:
            raise ValueError(f"{mesh} has {n} ranks; JAX runs at most {MAX_DEVICES} host devices here.")
        use_host_devices(max(n, 8))

    def run(self, program: Program, fn: Callable, *args, params=None, seed: int = 0, on_event=None,
            timeout_s: float = 600.0):
        self.prepare(program.mesh)
        params = program.init(seed) if params is None else params
        if program.pipeline is not None and program.offload:
            raise ValueError("--offload is built for JAX steps without a pipeline so far (the tick loop and the "
                             "per-stage driver keep AdamW's states on the device): drop --offload or the pp strategy")
        if program.pipeline is not None and self.mode is Mode.EXPLICIT and self.pipeline == "loop":
            from .ticks import JaxLoopSession

            return fn(JaxLoopSession(program, params, seed=seed, emit=on_event), *args)
        if program.pipeline is not None and self.mode is not Mode.SINGLE:
            from .pipeline import JaxPipelineSession

            return fn(JaxPipelineSession(program, params, seed=seed, emit=on_event, gspmd=self.mode is Mode.GSPMD),
                      *args)
        session = JaxSession(program, self.mode, params, seed=seed, emit=on_event)
        return fn(session, *args)


class JaxSession:
    rank, lead = 0, True

    def __init__(self, program: Program, mode: Mode | str, params: Mapping[str, np.ndarray], *, seed: int = 0,
                 emit: Callable | None = None, devices=None):
        self.program, self.mode, self.seed, self._emit = program, Mode(mode), seed, emit
        self.log = CollectiveLog()  # explicit mode: the plan steps the traced step executed
        self._sums: dict | None = None  # explicit mode: the axes each parameter's gradient sums over
        # explicit mode, k microbatches: the parameters summed per microbatch, and why a step fell back to that
        self.accumulation: dict = {"per_microbatch": [], "fell_back": None}
        self.tx = make_optimizer(program.optimizer)
        self.scaler = LossScale.of(program.precision)  # fp16's dynamic loss scale (None: no scaling)
        if self.mode is Mode.SINGLE:
            self.device = (devices or jax.devices())[0]
        elif self.mode is Mode.EXPLICIT:
            self.atoms = AtomMesh(program.mesh)
            self.jax_mesh = self.atoms.jax_mesh(devices)
        else:
            self.jax_mesh = lower_mesh(program.mesh, devices, axis_type=AxisType.Auto)
        self._step = jax.jit(self._train_step, donate_argnums=0)
        self._grads = jax.jit(self._loss_and_grads, static_argnames="training")
        self._eval = jax.jit(functools.partial(self._loss, training=False))
        self.count = 0
        self.state = self.init(params)

    # -- placement -------------------------------------------------------------------------------------
    def _sharding(self, layout: Layout) -> NamedSharding:
        if self.mode is Mode.EXPLICIT:
            return NamedSharding(self.jax_mesh, self.atoms.spec(layout))
        return lower_layout(layout, self.jax_mesh)

    def _place(self, tree: Mapping[str, Any], role: Role):
        if self.mode is Mode.SINGLE:
            return {k: jax.device_put(np.asarray(v), self.device) for k, v in tree.items()}
        return {k: put(v, self._sharding(self.program.layouts[role][k])) for k, v in tree.items()}

    def _ordered(self, arrays):
        """The explicit lowering's inputs in the sequence order its executor follows (GSPMD's
        dense ops see the sequence in its own order)."""
        return in_order(self.program, arrays) if self.mode is Mode.EXPLICIT else arrays

    def _place_batch(self, batch):
        return self._place(self._ordered(check_batch(self.program, batch)), Role.ACTIVATIONS)

    def _place_microbatches(self, batch):
        """A step's batch for the jitted step: itself, or its k microbatches stacked on a new
        leading dim (each sharded as the microbatch program says, the stack dim whole)."""
        p = self.program
        if p.microbatches == 1:
            return self._place_batch(batch)
        parts = microbatches(p, batch)
        parts = [(self._ordered(arrays), rows) for arrays, rows in parts]
        stacked = {n: np.stack([arrays[n] for arrays, _ in parts]) for n in p.inputs}
        if self.mode is Mode.SINGLE:
            return {n: jax.device_put(v, self.device) for n, v in stacked.items()}
        out = {}
        for n, v in stacked.items():
            spec = self._sharding(p.micro.layouts[Role.ACTIVATIONS][n]).spec
            out[n] = put(v, NamedSharding(self.jax_mesh, PartitionSpec(None, *spec)))
        return out

    # -- the loss in each mode -------------------------------------------------------------------------
    def _dense_ops(self, training: bool, step, rows=(1, 0)) -> DenseOps:
        rng = DropoutKey(self.seed, step, rows=rows)
        dtype = self.program.precision.dtype
        if self.mode is Mode.SINGLE:
            return DenseOps(JaxLocal(), training=training, rng=rng, dtype=dtype)
        return gspmd_ops(self.program, self._sharding, training=training, rng=rng, dtype=dtype)

    def _loss(self, params, batch, step, training: bool = True, wrap_ops=None, program: Program | None = None,
              rows=(1, 0)):
        if self.mode is Mode.EXPLICIT:
            return self._explicit_loss(params, batch, step, training, wrap_ops, program=program, rows=rows)
        p = self.program if program is None else program
        ops = self._dense_ops(training, step, rows)
        if wrap_ops is not None:
            return p.model.loss(wrap_ops(ops), params, batch)
        return remat_loss(p.model, p.remat, ops, params, batch, jax_checkpoint(p.remat) if training else None)

    def _explicit_loss(self, params, batch, step, training, wrap_ops=None, program: Program | None = None,
                       rows=(1, 0)):
        """The whole forward in shard_map; every redistribution is a core plan on lax collectives.
        ``wrap_ops(ops)``, if given, wraps the executor (the bisect records every op through it)."""
        p, atoms = self.program if program is None else program, self.atoms
        local = functools.partial(self._local_loss, p, training=training, wrap_ops=wrap_ops)
        spec = lambda role, k: atoms.spec(p.layouts[role][k])
        in_specs = ({k: spec(Role.PARAMS, k) for k in params}, {k: spec(Role.ACTIVATIONS, k) for k in batch},
                    PartitionSpec(), PartitionSpec())
        rows = jax.numpy.asarray(rows, jax.numpy.int32)
        return jax.shard_map(local, mesh=self.jax_mesh, in_specs=in_specs, out_specs=PartitionSpec())(
            params, batch, step, rows)

    def _local_loss(self, p: Program, params, batch, step, rows, *, training=True, wrap_ops=None):
        """One device's loss inside ``shard_map`` on the core executor (``JaxComm``)."""
        comm = JaxComm(self.atoms, self.log)
        sp, sb = sharded_params(p, params), input_values(p, batch)
        ops = make_executor(p, comm, sp, coalesce=False, training=training, step=step, seed=self.seed,
                            rows=(rows[0], rows[1]))
        if wrap_ops is not None:
            return scalar_loss(ops, p.model.loss(wrap_ops(ops), sp, sb))
        checkpoint = jax_checkpoint(p.remat) if training else None
        return scalar_loss(ops, remat_loss(p.model, p.remat, ops, sp, sb, checkpoint))

    def _summed_over(self) -> dict[str, tuple[str, ...]]:
        """``gradient_sums`` of the microbatch program, once per session (a parameter summed over two
        different sets keeps its sums per microbatch: ``accumulation["per_microbatch"]``)."""
        if self._sums is None:
            self._sums, self.accumulation["per_microbatch"] = gradient_sums(self.program.micro)
        return self._sums

    def _accumulated(self, params, batch, step, training: bool, seed):
        """JAX explicit's k microbatches in one ``shard_map``: each parameter made to vary over the
        axes its gradient is summed over once, before the loop (``_summed_over``), so each
        microbatch's gradient stays this device's partial one; the loop adds them up and the step
        sums each once after the last, as torch's buckets do (DDP's ``no_sync``), not k times.
        None where the executor's account disagrees with that (``VarianceMismatch``: a parameter
        also used where it is not varied over those axes); the caller then sums per microbatch."""
        p, atoms, k, jnp = self.program, self.atoms, self.program.microbatches, jax.numpy
        micro, sums = p.micro, self._summed_over()

        def local(params, batch, step):
            comm = JaxComm(atoms)  # its ``vary``: a pcast over the atoms ``v`` does not vary over yet
            varied = {n: comm.vary(v, sums[n]) if sums.get(n) else v for n, v in params.items()}

            def one(carry, xs):
                mb, i = xs
                rows = jnp.stack([jnp.int32(k), i])
                weighted = lambda ps: seed(self._local_loss(micro, ps, mb, step, rows, training=training) / k)
                return jax.tree.map(jnp.add, carry, jax.value_and_grad(weighted)(varied)), None

            zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, varied))
            (loss, grads), _ = lax.scan(one, zeros, (batch, jnp.arange(k, dtype=jnp.int32)))
            with jax.named_scope(BACKWARD):  # the backward's last collectives (jaxpr_traffic reads it)
                return loss, {n: lax.psum(g, atoms.names(sums[n])) if sums.get(n) else g for n, g in grads.items()}

        pspec = {n: atoms.spec(p.layouts[Role.PARAMS][n]) for n in params}
        bspec = {n: PartitionSpec(None, *atoms.spec(micro.layouts[Role.ACTIVATIONS][n])) for n in batch}
        mark = len(self.log.entries)
        try:
            return jax.shard_map(local, mesh=self.jax_mesh, in_specs=(pspec, bspec, PartitionSpec()),
                                 out_specs=(PartitionSpec(), pspec))(params, batch, step)
        except VarianceMismatch as e:
            del self.log.entries[mark:]
            self.accumulation["fell_back"] = str(e)
            warnings.warn(f"JAX explicit sums each parameter's gradient every microbatch in this step ({k} times the "
                          f"bytes of one sum): varying the parameters once before the microbatch loop disagrees with "
                          f"the executor's account ({e})", stacklevel=2)
            return None

    def _loss_and_grads(self, params, batch, step, training: bool = True, scale=None):
        """The loss and gradients; ``scale``: fp16's loss scale, the backward's seed (the gradients
        come back scaled)."""
        k = self.program.microbatches
        seed = (lambda loss: loss) if scale is None else (lambda loss: loss * scale)
        if k == 1:
            loss, grads = jax.value_and_grad(lambda *a: seed(self._loss(*a)))(params, batch, step, training)
            loss = loss if scale is None else loss / scale
        elif self.mode is Mode.EXPLICIT and (summed := self._accumulated(params, batch, step, training,
                                                                          seed)) is not None:
            loss, grads = summed
            loss = loss if scale is None else loss / scale
        else:
            # Gradient accumulation: a scan over the stacked microbatches (one microbatch's
            # activations live at a time), each loss weighted 1/k before its gradient.
            micro, jnp = self.program.micro, jax.numpy

            def one(carry, xs):
                mb, i = xs
                weighted = lambda p: seed(self._loss(p, mb, step, training, program=micro, rows=(k, i)) / k)
                loss, grads = jax.value_and_grad(weighted)(params)
                loss = loss if scale is None else loss / scale
                return jax.tree.map(jnp.add, carry, (loss, grads)), None

            zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
            (loss, grads), _ = jax.lax.scan(one, zeros, (batch, jnp.arange(k, dtype=jnp.int32)))
        if self.mode is not Mode.SINGLE:
            layouts = self.program.layouts[Role.GRADS]
            grads = {k: jax.lax.with_sharding_constraint(g, self._sharding(layouts[k])) for k, g in grads.items()}
        return loss, grads

    def _train_step(self, state, batch, step, lr, scale=None):
        """One update; under fp16's loss scale (``scale``), the gradients are unscaled first and a
        step whose gradients are not all finite leaves the state as it was (core/precision.py)."""
        loss, grads = self._loss_and_grads(state["params"], batch, step, scale=scale)
        state = {"params": state["params"], "opt": self._opt_to(state["opt"], "device")}  # offload: in for the update
        finite = jax.numpy.bool_(True)
        if scale is not None:
            grads = jax.tree.map(lambda g: g / scale, grads)
            finite = jax.numpy.isfinite(optax.tree.norm(grads))
        updates, opt = self.tx.update(grads, state["opt"], state["params"])
        params = jax.tree.map(lambda p, u: p - lr * u, state["params"], updates)
        if scale is not None:
            keep = lambda new, old: jax.tree.map(lambda a, b: jax.numpy.where(finite, a, b), new, old)
            params, opt = keep(params, state["params"]), keep(opt, state["opt"])
        if self.mode is not Mode.SINGLE:
            layouts = self.program.layouts[Role.PARAMS]
            params = {k: jax.lax.with_sharding_constraint(v, self._sharding(layouts[k])) for k, v in params.items()}
        return {"params": params, "opt": self._opt_to(opt, HOST)}, (loss, finite)

    # -- state -----------------------------------------------------------------------------------------
    def init(self, params: Mapping[str, np.ndarray]):
        p = self._place(params, Role.PARAMS)
        return {"params": p, "opt": self._init_opt(p)}

    def _init_opt(self, params):
        """Optimizer states made where they live, in the optimizer layouts (works across processes);
        under offload, in the host's memory."""
        if self.mode is Mode.SINGLE:
            return jax.jit(lambda p: self._opt_to(self.tx.init(p), HOST))(params)
        init = lambda p: self._opt_to(jax.tree_util.tree_map_with_path(self._place_opt_leaf, self.tx.init(p)), HOST)
        return jax.jit(init)(params)

    def _opt_sharding(self, path, leaf):
        if self.mode is Mode.SINGLE:
            return jax.sharding.SingleDeviceSharding(self.device)
        name = getattr(path[-1], "key", None)
        layouts = self.program.layouts[Role.OPTIMIZER]
        if isinstance(name, str) and name in layouts and leaf.ndim:
            return self._sharding(layouts[name])
        return NamedSharding(self.jax_mesh, PartitionSpec())

    def _place_opt_leaf(self, path, leaf):
        return jax.lax.with_sharding_constraint(leaf, self._opt_sharding(path, leaf))

    def _opt_to(self, opt, kind: str):
        """Under ``--offload`` (``Program.offload``, ZeRO-Offload's placement): AdamW's states
        moved to memory ``kind`` ("pinned_host" between steps, "device" for the update) inside the
        jitted step; without offload, as they are."""
        if not self.program.offload:
            return opt
        move = lambda path, leaf: jax.device_put(leaf, self._opt_sharding(path, leaf).with_memory_kind(kind))
        return jax.tree_util.tree_map_with_path(move, opt)

    # -- the Session contract ----------------------------------------------------------------------------
    def _step_args(self, batch):
        """The jitted step's arguments besides the state: the batch, the step's two words, the rate."""
        args = (self._place_microbatches(batch), step_words(self.count),
                np.float32(self.program.optimizer.lr_at(self.count)))
        return args if self.scaler is None else args + (np.float32(self.scaler.scale),)

    def step(self, batch) -> float:
        self.state, (loss, finite) = self._step(self.state, *self._step_args(batch))
        if self.scaler is None or self.scaler.update(bool(fetch(finite))):
            self.count += 1  # a step skipped for overflow takes no update
        return float(fetch(loss))

    def step_hlo(self, batch) -> str:
        """The optimized HLO of the compiled training step (benchmarks read its collectives)."""
        return self._step.lower(self.state, *self._step_args(batch)).compile().as_text()

    def traffic(self, batch) -> CollectiveLog:
        """Every collective device 0 runs in one ``loss_and_grads`` of JAX explicit, forward and
        backward, read from the jaxpr it runs (backends/jax/jaxpr_traffic.py); traced, not run."""
        from .jaxpr_traffic import jaxpr_traffic

        if self.mode is Mode.SINGLE:
            raise ValueError("traffic: the single-device session runs no collectives")
        if self.mode is not Mode.EXPLICIT:
            raise ValueError(f"traffic: the {self.mode.value} session runs XLA's own collectives (GSPMD); their "
                             f"jaxpr holds none. Read its compiled HLO instead (backends/jax/hlo.py)")
        closed = jax.make_jaxpr(self._loss_and_grads)(self.state["params"], self._place_microbatches(batch),
                                                      step_words(self.count))
        return jaxpr_traffic(closed, self.atoms)

    def eval_loss(self, batch) -> float:
        return float(fetch(self._eval(self.state["params"], self._place_batch(batch), step_words(self.count))))

    def loss_and_grads(self, batch):
        scale = None if self.scaler is None else np.float32(self.scaler.scale)
        loss, grads = self._grads(self.state["params"], self._place_microbatches(batch), step_words(self.count),
                                  scale=scale)
        unscale = 1.0 if scale is None else 1.0 / float(scale)
        return float(fetch(loss)), {k: fetch(v) * np.float32(unscale) for k, v in grads.items()}

    def params(self) -> dict[str, np.ndarray]:
        return {k: fetch(v) for k, v in self.state["params"].items()}

    def barrier(self) -> None:
        pass

    def emit(self, event) -> None:
        if self._emit is not None:
            self._emit(event)

    # -- checkpoints: blocks in, blocks out (no whole tensor on the host) ----------------------------------
    def _opt_leaves(self, opt):
        """(kind, name, leaf) for each optimizer-state leaf: ("mu"|"nu", param name) or ("count", None)."""
        out = []
        for path, leaf in jax.tree_util.tree_flatten_with_path(opt)[0]:
            attrs = [getattr(k, "name", None) for k in path]
            name = getattr(path[-1], "key", None)
            if "mu" in attrs or "nu" in attrs:
                out.append(("mu" if "mu" in attrs else "nu", name, leaf))
            elif "count" in attrs:
                out.append(("count", None, leaf))
            else:
                raise ValueError(f"optimizer state leaf at {jax.tree_util.keystr(path)} is not Adam's mu, nu or count.")
        return out

    def checkpoint_tensors(self):
        """Pieces from the arrays' own shards (replica 0 of each block, in the file of the mesh rank
        whose device holds it); blocks of this process's devices only."""
        if self.mode is Mode.SINGLE:
            raise ValueError("checkpoints are saved from a sharded run (mode explicit or gspmd), not the single-device "
                             "reference.")
        state, lay = self.state, self.program.layouts
        named = [(f"params/{k}", v, lay[Role.PARAMS][k]) for k, v in state["params"].items()]
        for kind, name, leaf in self._opt_leaves(state["opt"]):
            if kind != "count":  # the count is self.count (Adam's int32 one saturates)
                named.append((f"opt/{kind}/{name}", leaf, lay[Role.OPTIMIZER][name]))
        return (*checkpoint_pieces(named, self.jax_mesh), self.count)

    def restore(self, ckpt, params_only: bool = False) -> None:
        """Each device's block is read from the pieces it overlaps. ``params_only``: a fresh optimizer."""
        shapes = self.program.shapes

        def load(name, shape, sharding):
            return jax.make_array_from_callback(tuple(shape), sharding, lambda index: ckpt.read(
                name, tuple(map(slice, *box(index, shape))), shape=shape))

        if self.mode is Mode.SINGLE:
            raise ValueError("restore into a sharded run (mode explicit or gspmd).")
        lay = self.program.layouts
        params = {k: load(f"params/{k}", shapes[k], self._sharding(lay[Role.PARAMS][k])) for k in shapes}
        opt = self._init_opt(params)
        if params_only:
            self.state, self.count = {"params": params, "opt": opt}, 0
            return
        count = ckpt.count()
        leaves = []
        for kind, name, leaf in self._opt_leaves(opt):
            if kind == "count":  # where Adam's count would be after ``count`` updates: it saturates
                leaves.append(jax.device_put(np.asarray(min(count, np.iinfo(leaf.dtype).max), leaf.dtype),
                                             leaf.sharding))
            else:
                leaves.append(load(f"opt/{kind}/{name}", shapes[name], leaf.sharding))
        self.state = {"params": params, "opt": jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(opt), leaves)}
        self.count = count

    # -- the bisect's recording ---------------------------------------------------------------------------
    def trace(self, batch) -> list:
        with jax.default_matmul_precision("highest"):  # no TF32 on GPUs: fp32 is what is compared
            if self.mode is Mode.EXPLICIT:
                return self._trace_explicit(batch)
            return self._trace_dense(batch)

    def _trace_dense(self, batch) -> list:
        """Single and GSPMD: the ops' outputs are (global) arrays; XLA's collectives are not ours to tap."""
        holder: dict = {}

        def run(params, batch):
            outs: list = []
            holder["rec"] = Recorder(self._dense_ops(False, 0), lambda probe, out: outs.append(out))
            self.program.model.loss(holder["rec"], params, batch)
            return outs

        outs = jax.jit(run)(self.state["params"], self._place_batch(batch))
        probes = holder["rec"].probes
        for probe, out in zip(probes, outs):
            probe.value = fetch(out)
        return probes

    def _trace_explicit(self, batch) -> list:
        """Each device's block of every op's output and of every plan step's input and output leave
        the trace through ``jax.debug.callback``; the host assembles and checks them."""
        from jax import lax

        atoms = self.atoms.atom_names
        blocks: dict = {}  # key -> {rank: block}
        pending: list = []  # (probe, plan, i)
        holder: dict = {}

        def host(key, rank, value):
            blocks.setdefault(key, {})[int(rank)] = np.asarray(value)

        def emit(key, local):
            jax.debug.callback(functools.partial(host, key), lax.axis_index(atoms), local)

        def capture(probe, out):
            probe.layout = out.layout
            emit(("op", probe.index), out.local)

        def on_step(probe, plan, i, before, after):
            n = len(pending)
            emit(("in", n), before)
            emit(("out", n), after)
            pending.append((probe, plan, i))

        def wrap(ops):
            pending.clear()
            holder["rec"] = Recorder(ops, capture, on_step)
            return holder["rec"]

        loss = jax.jit(lambda p, b: self._explicit_loss(p, b, step_words(0), False, wrap_ops=wrap))(
            self.state["params"], self._place_batch(batch))
        jax.block_until_ready(loss)
        jax.effects_barrier()
        world = self.program.mesh.size
        probes = holder["rec"].probes
        for probe in probes:
            probe.pieces = blocks.get(("op", probe.index), {})
            assemble(probe, world)
        probes = probes + holder["rec"].outside
        for n, (probe, plan, i) in enumerate(pending):
            before, after = blocks.get(("in", n), {}), blocks.get(("out", n), {})
            probe.steps.append(check_step(plan, i, [before[r] for r in range(world)], [after[r] for r in range(world)]))
        return probes
