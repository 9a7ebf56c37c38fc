"""The JAX explicit mode's pipeline as one compiled step: a tick loop inside ``shard_map``.

The whole mesh, pp axis included, runs one program. ``core.ticks.lower_to_ticks`` turns the
schedule into a table: at tick t, pp rank r runs one (op, stage) branch (or nothing) on one
microbatch, reading its stage input and output gradient from buffer slots. The loop is a
``lax.scan`` over ticks; each tick is a ``lax.switch`` on the rank's row (a rank computes nothing
in its bubbles), then one ``ppermute`` over pp per offset the schedule's values travel by, and
the arriving values are written to the slots the table names. Memory follows the schedule: the
loop carries ``x`` and ``dy`` buffers of as many slots as the schedule holds at once (GPipe's m
stage inputs, 1F1B's p), the gradients, and one branch's temporaries; a backward recomputes its
stage under ``jax.vjp`` from the stashed input (B, or I and W apart for zero-bubble schedules).

Every pp rank runs the same program, so its stages' parameters must have the same shapes: the
parameters that one layer alone uses are stacked as ``[pp, v, *shape]`` (position q of stage s's
layers in slot q, stage s at its rank and chunk), sharded over pp, each block in its usual layout
over the other axes; the rest (embedding, head, tied or shared tables) are held whole by every
pp rank, and their gradients are summed over pp after the loop. The stack is this session's
internal form: parameters, gradients and checkpoints go in and out under their own names.

The update is the other modes' one: optax's global-norm clipping and AdamW under ``jit`` on the
stacked tree (each parameter counted once), the learning rate from the host.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from ...core.executor import Sharded
from ...core.log import CollectiveLog
from ...core.ops import step_words
from ...core.pipeline import PipelineError
from ...core.program import Program
from ...core.remat import run_layers
from ...core.schedule import Op
from ...core.session import input_values, make_executor, microbatches, scalar_loss
from ...core.shapes import part_params
from ...core.strategies import Role
from ...core.ticks import TO_DY, TO_X, TickPlan, forward_ticks, lower_to_ticks
from .comm import JaxComm, VarianceMismatch, _vma
from .distributed import fetch, put
from .mesh import AtomMesh
from .pipeline import PipelinedSession, pipeline_checkpoint, stage_program
from .remat import jax_checkpoint
from .session import make_optimizer

__all__ = ["JaxLoopSession", "Stacking", "stacking"]

STACK = "stack:"  # the prefix of a stacked slot's key in the session's parameter tree


@dataclass(frozen=True)
class Stacking:
    """``names[s][q]``: stage s's parameter in slot q (slot q is named by stage 0's); ``where[s]``:
    (pp rank, chunk) of stage s; ``shared``: the parameters every pp rank holds whole."""

    names: tuple[tuple[str, ...], ...]
    where: tuple[tuple[int, int], ...]
    shared: tuple[str, ...]
    ranks: int
    chunks: int

    @property
    def slots(self) -> tuple[str, ...]:
        return self.names[0]


def stacking(program: Program, sub: Program) -> Stacking:
    """How ``program``'s pipeline stacks its stages' parameters (one ``PipelineError`` listing every
    stage whose parameters differ from stage 0's)."""
    pipe, model = program.pipeline, program.model
    sc = pipe.schedule
    uses = part_params(model, sub.batch)
    count = Counter(n for names in uses.values() for n in names)
    order = list(program.shapes)
    own = lambda i: [n for n in order if n in uses[i] and count[n] == 1]
    names = tuple(tuple(n for i in pipe.layers_of_stage[s] for n in own(i)) for s in range(pipe.stages))
    lay = lambda role, n: sub.layouts[role][n]
    problems = []
    for s in range(1, pipe.stages):
        if len(names[s]) != len(names[0]):
            problems.append(f"stage {s} has {len(names[s])} parameters of its own, stage 0 has {len(names[0])}")
            continue
        for a, b in zip(names[0], names[s]):
            if program.shapes[a] != program.shapes[b]:
                problems.append(f"stage {s}'s {b} has shape {program.shapes[b]}, stage 0's {a} {program.shapes[a]}")
            elif any(lay(r, a) != lay(r, b) for r in (Role.PARAMS, Role.GRADS, Role.OPTIMIZER)):
                problems.append(f"stage {s}'s {b} is laid out {lay(Role.PARAMS, b)}, stage 0's {a} "
                                f"{lay(Role.PARAMS, a)}")
    if problems:
        raise PipelineError(
            f"the JAX tick loop runs every pp rank's stages as one program, so it stacks stage s's parameters "
            f"on stage 0's; {type(model).__name__}'s stages differ (run it with --mode mpmd, backend jax-mpmd: one "
            f"program per stage):", problems)
    stacked = {n for ns in names for n in ns}
    where = tuple((sc.rank_of(s), sc.stages_of(sc.rank_of(s)).index(s)) for s in range(pipe.stages))
    return Stacking(names, where, tuple(n for n in order if n not in stacked), sc.ranks, sc.virtual)


class _LoopComm(JaxComm):
    """The executor's collectives inside the loop: every value also varies over pp (each pp rank
    runs its own stage), which the executor, running one stage, does not count."""

    def __init__(self, atoms: AtomMesh, log, pp: tuple[str, ...]):
        super().__init__(atoms, log)
        self.pp = frozenset(pp)

    def check(self, x: Sharded) -> None:
        extra = sorted(_vma(x.local) - set(self.atoms.names(x.varying)) - self.pp)
        if extra:
            raise VarianceMismatch(f"JAX says a value of layout {x.layout} and shape {x.shape} varies over {extra}, but "
                                   f"the executor's account says it varies over {sorted(x.varying)} only.")


def _vary(x, names):
    """``x`` marked as varying over ``names`` too (JAX's type for a value that differs per rank)."""
    missing = tuple(n for n in names if n not in _vma(x))
    return lax.pcast(x, missing, to="varying") if missing else x


class JaxLoopSession(PipelinedSession):

    def __init__(self, program: Program, params: Mapping[str, np.ndarray], *, seed: int = 0,
                 emit: Callable | None = None, devices=None):
        self.program, self.seed, self._emit = program, seed, emit
        self.pipe = pipe = program.pipeline
        mesh = program.mesh
        self.log = CollectiveLog()
        self.sub = stage_program(program)
        self.stack = stacking(program, self.sub)
        self.atoms, self.sub_atoms = AtomMesh(mesh), AtomMesh(self.sub.mesh)
        self.jax_mesh = self.atoms.jax_mesh(devices)
        self.pp = self.atoms.names((pipe.axis,))
        self.train_plan, self.eval_plan = lower_to_ticks(pipe.schedule), forward_ticks(pipe.schedule)
        shape, dims = program.model.residual(self.sub.batch)
        self.x_shape, self.x_dims = tuple(shape), dims
        self.x_layout = self.sub.activation(dims, shape)
        self.tx = make_optimizer(program.optimizer)
        self.tables = {id(plan): put(plan.table, self._pp_sharding(PartitionSpec()))
                       for plan in (self.train_plan, self.eval_plan)}
        self._step = jax.jit(self._train_step, donate_argnums=0)
        self._grads = jax.jit(lambda p, b, t, s: self._run(self.train_plan, True, p, b, t, s))
        self._eval = jax.jit(lambda p, b, t, s: self._run(self.eval_plan, False, p, b, t, s)[0])
        self.count = 0
        self.state = self._init_state(params)

    # -- the stacked tree ------------------------------------------------------------------------------
    def _pp_sharding(self, inner: PartitionSpec) -> NamedSharding:
        pp = self.pp if len(self.pp) > 1 else self.pp[0]
        return NamedSharding(self.jax_mesh, PartitionSpec(pp, *inner))

    def _spec(self, key: str, role: Role) -> PartitionSpec:
        """The local-block spec of a tree entry (a stacked slot: pp, the chunk, the slot's layout)."""
        if key.startswith(STACK):
            inner = self.sub_atoms.spec(self.sub.layouts[role][key[len(STACK):]])
            pp = self.pp if len(self.pp) > 1 else self.pp[0]
            return PartitionSpec(pp, None, *inner)
        return self.sub_atoms.spec(self.sub.layouts[role][key])

    def _sharding(self, key: str, role: Role) -> NamedSharding:
        return NamedSharding(self.jax_mesh, self._spec(key, role))

    def _stacked(self, values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Global numpy values by name -> the session's tree (numpy)."""
        st, shapes = self.stack, self.program.shapes
        tree = {}
        for q, slot in enumerate(st.slots):
            arr = np.zeros((st.ranks, st.chunks, *shapes[slot]), np.float32)
            for s, (r, j) in enumerate(st.where):
                arr[r, j] = values[st.names[s][q]]
            tree[STACK + slot] = arr
        tree.update({k: np.asarray(values[k], np.float32) for k in st.shared})
        return tree

    def _unstacked(self, tree) -> dict[str, np.ndarray]:
        st = self.stack
        out = {}
        for q, slot in enumerate(st.slots):
            arr = fetch(tree[STACK + slot])
            for s, (r, j) in enumerate(st.where):
                out[st.names[s][q]] = arr[r, j]
        out.update({k: fetch(tree[k]) for k in st.shared})
        return {k: out[k] for k in self.program.shapes}

    def _place(self, tree, role: Role):
        return {k: put(v, self._sharding(k, role)) for k, v in tree.items()}

    def _init_state(self, params):
        placed = self._place(self._stacked(params), Role.PARAMS)
        return {"params": placed, "opt": self._init_opt(placed)}

    def _init_opt(self, params):
        def leaf(path, x):
            key = getattr(path[-1], "key", None)
            if isinstance(key, str) and key in params and x.ndim:
                return lax.with_sharding_constraint(x, self._sharding(key, Role.OPTIMIZER))
            return lax.with_sharding_constraint(x, NamedSharding(self.jax_mesh, PartitionSpec()))
        return jax.jit(lambda p: jax.tree_util.tree_map_with_path(leaf, self.tx.init(p)))(params)

    def _place_batch(self, batch):
        """The step's microbatches stacked on a leading dim, each sharded as one stage's program says
        (whole over pp: every pp rank reads what its first or last stage needs)."""
        parts = microbatches(self.program, batch)
        out = {}
        for n in self.sub.inputs:
            spec = self.sub_atoms.spec(self.sub.layouts[Role.ACTIVATIONS][n])
            out[n] = put(np.stack([arrays[n] for arrays, _ in parts]),
                         NamedSharding(self.jax_mesh, PartitionSpec(None, *spec)))
        return out

    # -- the loop --------------------------------------------------------------------------------------
    def _run(self, plan: TickPlan, training: bool, params, batch, table, step):
        """(mean loss, gradients in the tree's form) of one step's microbatches through ``plan``."""
        keys = list(params)
        in_specs = ({k: self._spec(k, Role.PARAMS) for k in keys},
                    {n: PartitionSpec(None, *self.sub_atoms.spec(self.sub.layouts[Role.ACTIVATIONS][n]))
                     for n in batch},
                    self._pp_sharding(PartitionSpec()).spec, PartitionSpec())
        out_specs = (PartitionSpec(), {k: self._spec(k, Role.PARAMS) for k in keys})
        local = lambda p, b, t, s: self._local(plan, training, p, b, t, s)
        return jax.shard_map(local, mesh=self.jax_mesh, in_specs=in_specs, out_specs=out_specs)(
            params, batch, table, step)

    def _local(self, plan: TickPlan, training: bool, params, batch, table, step):
        sub, pipe, model, st = self.sub, self.pipe, self.program.model, self.stack
        pp, S, m = self.pp, pipe.stages, pipe.microbatches
        comm = _LoopComm(self.sub_atoms, self.log, pp)
        params = {k: _vary(v, pp) for k, v in params.items()}  # no pp sum hides in a branch's backward
        stk = {k[len(STACK):]: v[0] for k, v in params.items() if k.startswith(STACK)}  # (chunks, *block)
        rep = {k: v for k, v in params.items() if not k.startswith(STACK)}
        lay = sub.layouts[Role.PARAMS]
        x_names = tuple(pp) + self.sub_atoms.names(self.x_layout.spec.axes)
        x_block = self.x_layout.local_shape(self.x_shape)
        # NaN wherever nothing was computed: a slot read before its value arrived, or a value sent
        # where the table sends nothing, would poison the loss (praxis fills its bubbles so too).
        nan_x = _vary(jnp.full(x_block, jnp.nan, self.program.precision.compute), x_names)  # what stages send

        def stage_params(s: int) -> dict:
            j = st.where[s][1]
            out = {n: stk[slot][j] for n, slot in zip(st.names[s], st.slots)}
            out.update({n: rep[n] for n in st.shared if n in pipe.params_of_stage[s]})
            return out

        def run_stage(s: int, sp: dict, x, inputs, mb):
            sharded = {n: Sharded(v, lay[n], sub.shapes[n], frozenset(lay[n].spec.axes), n) for n, v in sp.items()}
            ops = make_executor(sub, comm, sharded, coalesce=False, training=training, step=step, seed=self.seed,
                                rows=(m, mb))
            values = input_values(sub, inputs)
            h = model.embed(ops, sharded, values) if s == 0 else Sharded(
                x, self.x_layout, self.x_shape, frozenset(self.x_layout.spec.axes))
            h = run_layers(model, self.program.remat, ops, sharded, pipe.layers_of_stage[s], h,
                           jax_checkpoint(self.program.remat) if training else None)
            if s == S - 1:
                return scalar_loss(ops, model.head(ops, sharded, h, values))
            return _vary(ops.constrain(h, self.x_dims).local, x_names)

        def grads_of(s: int, dp: dict | None):
            """The branch's gradient increments: (per slot, this stage's chunk; per shared name)."""
            d_stk = {slot: jnp.zeros_like(stk[slot][0]) for slot in st.slots}
            d_rep = {n: jnp.zeros_like(v) for n, v in rep.items()}
            if dp is not None:
                d_stk.update({slot: dp[n] for n, slot in zip(st.names[s], st.slots)})
                d_rep.update({n: dp[n] for n in st.shared if n in dp})
            return d_stk, d_rep

        def branch(op: Op, s: int):
            last, j = s == S - 1, st.where[s][1]

            def run(xbuf, dybuf, row):
                mb = row[1]
                inputs = {n: lax.dynamic_index_in_dim(v, mb, 0, keepdims=False) for n, v in batch.items()}
                x = xbuf[jnp.maximum(row[2], 0)] if s > 0 else None
                sp = stage_params(s)
                f = lambda sp, x: run_stage(s, sp, x, inputs, mb)
                loss, out, dp = jnp.zeros((), jnp.float32), nan_x, None
                if op is Op.F:
                    y = f(sp, x)
                    loss, out = (y, out) if last else (loss, y)
                elif not (op is Op.I and s == 0):  # the first stage has no input gradient to make
                    if op is Op.I:
                        y, pull = jax.vjp(lambda x: f(sp, x), x)
                    elif op is Op.W or s == 0:
                        y, pull = jax.vjp(lambda sp: f(sp, x), sp)
                    else:  # B: to the input and the parameters
                        y, pull = jax.vjp(f, sp, x)
                    # the last stage seeds each microbatch with 1/m: the step's loss is their mean
                    dy = _vary(jnp.float32(1.0 / m), tuple(_vma(y))) if last else dybuf[jnp.maximum(row[3], 0)]
                    got = pull(dy)
                    if op is Op.I:
                        out = got[0]
                    elif op is Op.W or s == 0:
                        dp = got[0]
                    else:
                        dp, out = got
                d_stk, d_rep = grads_of(s, dp)
                return (_vary(out, x_names), d_stk, d_rep, _vary(loss, pp), jnp.int32(j))
            return run

        def idle(xbuf, dybuf, row):
            d_stk, d_rep = grads_of(0, None)
            return nan_x, d_stk, d_rep, _vary(jnp.zeros((), jnp.float32), pp), jnp.int32(0)

        fns = [idle] + [branch(op, s) for op, s in plan.branches]
        p = st.ranks

        def tick(carry, row):
            xbuf, dybuf, g_stk, g_rep, loss = carry
            out, d_stk, d_rep, d_loss, j = lax.switch(row[0], fns, xbuf, dybuf, row)
            g_stk = {k: lax.dynamic_update_index_in_dim(g, lax.dynamic_index_in_dim(g, j, 0, keepdims=False)
                                                        + d_stk[k], j, 0) for k, g in g_stk.items()}
            g_rep = {k: g + d_rep[k] for k, g in g_rep.items()}
            for shift in plan.shifts:
                got = out if shift == 0 else lax.ppermute(out, pp, [(r, (r + shift) % p) for r in range(p)])
                col = plan.column(shift)
                to, slot = row[col], jnp.maximum(row[col + 1], 0)
                if plan.x_slots:
                    xbuf = lax.dynamic_update_index_in_dim(xbuf, jnp.where(to == TO_X, got, xbuf[slot]), slot, 0)
                if plan.dy_slots:
                    dybuf = lax.dynamic_update_index_in_dim(dybuf, jnp.where(to == TO_DY, got, dybuf[slot]), slot, 0)
            return (xbuf, dybuf, g_stk, g_rep, loss + d_loss), None

        buf = lambda n: jnp.broadcast_to(nan_x, (max(n, 1), *x_block))
        carry = (buf(plan.x_slots), buf(plan.dy_slots), {k: jnp.zeros_like(v) for k, v in stk.items()},
                 {k: jnp.zeros_like(v) for k, v in rep.items()}, _vary(jnp.zeros((), jnp.float32), pp))
        (_, _, g_stk, g_rep, loss), _ = lax.scan(tick, carry, table[0])
        grads = {STACK + k: g[None] for k, g in g_stk.items()}
        grads.update({k: lax.psum(g, pp) for k, g in g_rep.items()})  # the embedding's and the head's, summed
        return lax.psum(loss, pp) / m, grads

    def _train_step(self, state, batch, table, step, lr):
        loss, grads = self._run(self.train_plan, True, state["params"], batch, table, step)
        grads = {k: lax.with_sharding_constraint(g, self._sharding(k, Role.GRADS)) for k, g in grads.items()}
        updates, opt = self.tx.update(grads, state["opt"], state["params"])
        params = {k: lax.with_sharding_constraint(v - lr * updates[k], self._sharding(k, Role.PARAMS))
                  for k, v in state["params"].items()}
        return {"params": params, "opt": opt}, loss

    # -- the Session contract --------------------------------------------------------------------------
    def _args(self, batch):
        return self._place_batch(batch), self.tables[id(self.train_plan)], step_words(self.count)

    def step(self, batch) -> float:
        lr = np.float32(self.program.optimizer.lr_at(self.count))
        self.state, loss = self._step(self.state, *self._args(batch), lr)
        self.count += 1
        return float(fetch(loss))

    def compiled_step(self, batch):
        """The compiled training step (its ``memory_analysis()`` is the schedule's memory)."""
        lr = np.float32(self.program.optimizer.lr_at(self.count))
        return self._step.lower(self.state, *self._args(batch), lr).compile()

    def loss_and_grads(self, batch):
        loss, grads = self._grads(self.state["params"], *self._args(batch))
        return float(fetch(loss)), self._unstacked(grads)

    def eval_loss(self, batch) -> float:
        return float(fetch(self._eval(self.state["params"], self._place_batch(batch),
                                      self.tables[id(self.eval_plan)], step_words(self.count))))

    def params(self) -> dict[str, np.ndarray]:
        return self._unstacked(self.state["params"])

    def _adam(self, opt):
        for i, part in enumerate(opt):
            if hasattr(part, "mu"):
                return i, part
        raise ValueError("the optimizer state holds no Adam moments")

    def checkpoint_tensors(self):
        _, adam = self._adam(self.state["opt"])
        values = {f"params/{k}": v for k, v in self.params().items()}
        values.update({f"opt/mu/{k}": v for k, v in self._unstacked(adam.mu).items()})
        values.update({f"opt/nu/{k}": v for k, v in self._unstacked(adam.nu).items()})
        return pipeline_checkpoint(self.program, values) + (self.count,)

    def restore(self, ckpt, params_only: bool = False) -> None:
        shapes = self.program.shapes
        self.state = self._init_state({k: ckpt.read(f"params/{k}", shape=s) for k, s in shapes.items()})
        self.count = 0
        if params_only:
            return
        count = ckpt.count()
        moments = [self._place(self._stacked({k: ckpt.read(f"opt/{kind}/{k}", shape=s) for k, s in shapes.items()}),
                               Role.OPTIMIZER) for kind in ("mu", "nu")]
        opt = list(self.state["opt"])
        i, adam = self._adam(opt)
        steps = jnp.asarray(min(count, np.iinfo(np.int32).max), adam.count.dtype)
        opt[i] = adam._replace(count=steps, mu=moments[0], nu=moments[1])
        self.state = {"params": self.state["params"], "opt": type(self.state["opt"])(opt)}
        self.count = count
