"""The JAX explicit mode's pipeline as one compiled step: a tick loop inside ``shard_map``.

The whole mesh, pp axis included, runs one program. ``core.ticks.lower_to_ticks`` turns the
schedule into a table: at tick t, pp rank r runs one (op, stage) branch (or nothing) on one
microbatch, reading its stage input and output gradient from buffer slots. The loop is a
``lax.scan`` over ticks; each tick is a ``lax.switch`` on the rank's row (a rank computes nothing
in its bubbles), then, per offset the schedule's values travel by, a ``ppermute`` over pp of the
stage outputs and one of the input gradients, each over only the ranks that send one this tick
(a ``lax.switch`` on the tick's pairs, the same on every rank; none in a tick where no rank sends),
and the arriving values are written to the slots the table names. Memory follows the schedule: the
loop carries ``x`` and ``dy`` buffers of as many slots as the schedule holds at once (GPipe's m
stage inputs, 1F1B's p), the gradients, and one branch's temporaries; a backward recomputes its
stage under ``jax.vjp`` from the stashed input (B, or I and W apart for zero-bubble schedules).

Every pp rank runs the same program, so its stages' parameters must have the same shapes: the
parameters that one layer alone uses are stacked as ``[pp, v, *shape]`` (position q of stage s's
layers in slot q, stage s at its rank and chunk), sharded over pp, each block in its usual layout
over the other axes; the rest (embedding, head, tied or shared tables) are held by every pp rank
(below). The stack is this session's internal form: parameters, gradients and checkpoints go in
and out under their own names.

Each rank's gradients are its own until the loop ends: a parameter is made to vary, before the
loop, over the axes the executor sums its gradient over (data parallelism's; ``gradient_sums``),
so no branch's ``jax.vjp`` sums it, and each is summed once after the last microbatch (as
torch's gradient buckets do), not once per microbatch. A parameter only one pp rank's stages use
(the embedding, the final norm, the head) is held per pp rank (``[pp, *shape]``, its row used on that rank
only): its gradient needs no sum over pp, and only its rank sums it over dp (a ``lax.switch`` on
the pp index). A tied table used on several pp ranks is held whole and its gradient summed over
pp, as torch sums it.

The update is the other modes' one: optax's global-norm clipping and AdamW under ``jit`` on the
stacked tree (each parameter counted once), the learning rate from the host.
"""

from __future__ import annotations

import warnings
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
from ...core.strategies import Role
from ...core.ticks import TO_DY, TO_X, TickPlan, forward_ticks, lower_to_ticks
from .comm import JaxComm, VarianceMismatch, _vma
from .distributed import fetch, put
from .jaxpr_traffic import BACKWARD, LOSS_MEAN, P2P, jaxpr_traffic
from .mesh import AtomMesh
from .pipeline import PipelinedSession, pipeline_checkpoint, stage_program
from .remat import jax_checkpoint
from .session import gradient_sums, make_optimizer

__all__ = ["JaxLoopSession", "Stacking", "stacking"]

STACK = "stack:"  # the prefix of a stacked slot's key in the session's parameter tree
OWN = "own:"  # of a parameter one pp rank uses, held per pp rank
# the name scopes of the loop's run-time choices (``jaxpr_traffic`` is told device 0's)
TICK, SEND, OWNER = "parlay_tick", P2P, "parlay_owner_sums"


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
    order = list(program.shapes)
    names = pipe.stacked_of_stage
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


def _scoped(names, fn, *args):
    """``fn(*args)`` traced inside the nested name scopes ``names``."""
    if not names:
        return fn(*args)
    with jax.named_scope(names[0]):
        return _scoped(names[1:], fn, *args)


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
        st = self.stack
        self.owner = {n: pipe.ranks_of_param(n)[0] for n in st.shared if len(pipe.ranks_of_param(n)) == 1}
        # the axes each parameter's gradient is summed over once a step (a stacked slot: if every
        # stage's parameter in it is summed over the same ones); None: per microbatch (fallen back)
        sums, per_mb = gradient_sums(self.sub)
        self.sums: dict[str, tuple[str, ...]] | None = {}
        for q, slot in enumerate(st.slots):
            sets = {sums.get(names[q], ()) for names in st.names}
            self.sums[STACK + slot] = sets.pop() if len(sets) == 1 else ()
            if sets:
                per_mb.append(slot)
        self.sums.update({(OWN + n if n in self.owner else n): sums.get(n, ()) for n in st.shared})
        self.accumulation = {"per_microbatch": sorted(per_mb), "fell_back": None}
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
        pp = self.pp if len(self.pp) > 1 else self.pp[0]
        if key.startswith(STACK):
            return PartitionSpec(pp, None, *self.sub_atoms.spec(self.sub.layouts[role][key[len(STACK):]]))
        if key.startswith(OWN):
            return PartitionSpec(pp, *self.sub_atoms.spec(self.sub.layouts[role][key[len(OWN):]]))
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
        for k in st.shared:
            if k in self.owner:  # its rank's row; the others' are never read (zeros stay zeros)
                tree[OWN + k] = np.zeros((st.ranks, *shapes[k]), np.float32)
                tree[OWN + k][self.owner[k]] = values[k]
            else:
                tree[k] = np.asarray(values[k], np.float32)
        return tree

    def _unstacked(self, tree) -> dict[str, np.ndarray]:
        st = self.stack
        out = {}
        for q, slot in enumerate(st.slots):
            arr = fetch(tree[STACK + slot])
            for s, (r, j) in enumerate(st.where):
                out[st.names[s][q]] = arr[r, j]
        out.update({k: fetch(tree[OWN + k])[self.owner[k]] if k in self.owner else fetch(tree[k]) for k in st.shared})
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
        """(mean loss, gradients in the tree's form) of one step's microbatches through ``plan``.
        Where varying the parameters before the loop disagrees with the executor's account (a
        ``VarianceMismatch``: a parameter also used where it is not varied over those axes), the
        step sums each gradient in every backward piece instead, warns and says why
        (``accumulation["fell_back"]``)."""
        keys = list(params)
        in_specs = ({k: self._spec(k, Role.PARAMS) for k in keys},
                    {n: PartitionSpec(None, *self.sub_atoms.spec(self.sub.layouts[Role.ACTIVATIONS][n]))
                     for n in batch},
                    self._pp_sharding(PartitionSpec()).spec, PartitionSpec())
        out_specs = (PartitionSpec(), {k: self._spec(k, Role.PARAMS) for k in keys})
        once = training and self.sums is not None

        def run(once):
            local = lambda p, b, t, s: self._local(plan, training, once, p, b, t, s)
            return jax.shard_map(local, mesh=self.jax_mesh, in_specs=in_specs, out_specs=out_specs)(
                params, batch, table, step)
        mark = len(self.log.entries)
        try:
            return run(once)
        except VarianceMismatch as e:
            if not once:
                raise
            del self.log.entries[mark:]
            self.sums, self.accumulation["fell_back"] = None, str(e)
            warnings.warn(f"the JAX tick loop sums each parameter's gradient in every backward piece ({self.pipe.microbatches}"
                          f" times a step): varying the parameters once before the loop disagrees with the executor's "
                          f"account ({e})", stacklevel=2)
            return run(False)

    def _local(self, plan: TickPlan, training: bool, once: bool, params, batch, table, step):
        sub, pipe, model, st = self.sub, self.pipe, self.program.model, self.stack
        pp, S, m = self.pp, pipe.stages, pipe.microbatches
        comm = _LoopComm(self.sub_atoms, self.log, pp)
        sums = {k: self.sub_atoms.names(self.sums.get(k, ())) if once else () for k in params}
        # every value varies over pp (no pp sum hides in a branch's backward), and each parameter
        # over the axes its gradient is summed over once after the loop (none in a branch's)
        params = {k: _vary(v, pp + sums[k]) for k, v in params.items()}
        stk = {k[len(STACK):]: v[0] for k, v in params.items() if k.startswith(STACK)}  # (chunks, *block)
        own = {k[len(OWN):]: v[0] for k, v in params.items() if k.startswith(OWN)}  # this rank's row
        rep = {k: v for k, v in params.items() if not k.startswith((STACK, OWN))}
        lay = sub.layouts[Role.PARAMS]
        x_names = tuple(pp) + self.sub_atoms.names(self.x_layout.spec.axes)
        x_block = self.x_layout.local_shape(self.x_shape)
        # NaN wherever nothing was computed: a slot read before its value arrived, or a value sent
        # where the table sends nothing, would poison the loss (praxis fills its bubbles so too).
        nan_x = _vary(jnp.full(x_block, jnp.nan, self.program.precision.compute), x_names)  # what stages send

        def stage_params(s: int) -> dict:
            j = st.where[s][1]
            out = {n: stk[slot][j] for n, slot in zip(st.names[s], st.slots)}
            out.update({n: own[n] if n in own else rep[n] for n in st.shared if n in pipe.params_of_stage[s]})
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
            """The branch's gradient increments: per slot (this stage's chunk), per own and per shared name."""
            d_stk = {slot: jnp.zeros_like(stk[slot][0]) for slot in st.slots}
            d_own = {n: jnp.zeros_like(v) for n, v in own.items()}
            d_rep = {n: jnp.zeros_like(v) for n, v in rep.items()}
            if dp is not None:
                d_stk.update({slot: dp[n] for n, slot in zip(st.names[s], st.slots)})
                d_own.update({n: dp[n] for n in own if n in dp})
                d_rep.update({n: dp[n] for n in rep if n in dp})
            return d_stk, d_own, d_rep

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
                return (_vary(out, x_names), *grads_of(s, dp), _vary(loss, pp), jnp.int32(j))

            if op is Op.F:
                return run
            return lambda *a: _scoped((BACKWARD,), run, *a)  # a backward piece, its recomputation included

        def idle(xbuf, dybuf, row):
            return nan_x, *grads_of(0, None), _vary(jnp.zeros((), jnp.float32), pp), jnp.int32(0)

        fns = [idle] + [branch(op, s) for op, s in plan.branches]

        def send(out, perms, index, scope):
            """``out`` by the tick's pairs ``perms[index - 1]`` (none: index 0)."""
            if not perms:
                return nan_x
            moves = [lambda o: nan_x] + [lambda o, perm=perm: lax.ppermute(o, pp, list(perm)) for perm in perms]
            return _scoped(scope, lambda: lax.switch(index, moves, out))

        def tick(carry, row):
            xbuf, dybuf, g_stk, g_own, g_rep, loss = carry
            out, d_stk, d_own, d_rep, d_loss, j = _scoped((TICK,), lambda: lax.switch(row[0], fns, xbuf, dybuf, row))
            g_stk = {k: lax.dynamic_update_index_in_dim(g, lax.dynamic_index_in_dim(g, j, 0, keepdims=False)
                                                        + d_stk[k], j, 0) for k, g in g_stk.items()}
            g_own = {k: g + d_own[k] for k, g in g_own.items()}
            g_rep = {k: g + d_rep[k] for k, g in g_rep.items()}
            for i, shift in enumerate(plan.shifts):
                col, sc = plan.column(shift), plan.send_column(shift)
                if shift == 0:  # a rank to itself: a local copy
                    got_x = got_dy = out
                else:  # stage outputs forward, input gradients backward: two collectives where a tick has
                    # both by one offset (p = 2, ZB-V), each phase's bytes its own
                    got_x = send(out, plan.sends[i][0], row[sc], (f"{SEND}{shift}f",))
                    got_dy = send(out, plan.sends[i][1], row[sc + 1], (BACKWARD, f"{SEND}{shift}b"))
                to, slot = row[col], jnp.maximum(row[col + 1], 0)
                if plan.x_slots:
                    xbuf = lax.dynamic_update_index_in_dim(xbuf, jnp.where(to == TO_X, got_x, xbuf[slot]), slot, 0)
                if plan.dy_slots:
                    dybuf = lax.dynamic_update_index_in_dim(dybuf, jnp.where(to == TO_DY, got_dy, dybuf[slot]), slot,
                                                            0)
            return (xbuf, dybuf, g_stk, g_own, g_rep, loss + d_loss), None

        buf = lambda n: jnp.broadcast_to(nan_x, (max(n, 1), *x_block))
        zeros = lambda tree: {k: jnp.zeros_like(v) for k, v in tree.items()}
        carry = (buf(plan.x_slots), buf(plan.dy_slots), zeros(stk), zeros(own), zeros(rep),
                 _vary(jnp.zeros((), jnp.float32), pp))
        (_, _, g_stk, g_own, g_rep, loss), _ = lax.scan(tick, carry, table[0])
        with jax.named_scope(BACKWARD):  # each gradient's sums, once a step
            grads = {}
            for k, g in g_stk.items():  # each stage's parameter on its own, as the executor sums it
                axes = sums[STACK + k]
                grads[STACK + k] = (jnp.stack([lax.psum(g[c], axes) for c in range(g.shape[0])]) if axes else g)[None]
            grads.update({OWN + k: g[None] for k, g in self._owner_sums(g_own, sums).items()})
            for k, g in g_rep.items():  # a tied table: over the axes its holders sum it over, then over pp
                grads[k] = lax.psum(lax.psum(g, sums[k]) if sums[k] else g, pp)
        with jax.named_scope(LOSS_MEAN):
            loss = lax.psum(loss, pp) / m
        return loss, grads

    def _owner_sums(self, g_own: dict, sums: dict) -> dict:
        """The gradients of parameters one pp rank uses, each summed (once) on that rank only: a
        ``lax.switch`` on the pp index (``_owner_branches``), whose branch sums its rank's and
        gives the others as zeros (a rank never reads another's row; the sum makes a value
        invariant over the summed axes, so every branch's must be)."""
        if not any(sums[OWN + k] for k in g_own):
            return g_own
        ranks, lookup = self._owner_branches()

        def sums_of(r):
            def run(g):
                out = {}
                for k, v in g.items():
                    axes = sums[OWN + k]
                    if not axes:
                        out[k] = v
                    elif self.owner[k] == r:
                        out[k] = lax.psum(v, axes)
                    else:
                        out[k] = _vary(jnp.zeros(v.shape, v.dtype), tuple(sorted(_vma(v) - set(axes))))
                return out
            return run
        index = jnp.asarray(lookup, jnp.int32)[lax.axis_index(self.pp)]
        return _scoped((OWNER,), lambda: lax.switch(index, [sums_of(r) for r in ranks], g_own))

    def _owner_branches(self) -> tuple[list, list[int]]:
        """(the owner sums' branches: None, then each pp rank that owns a parameter; each pp rank's branch)."""
        ranks = [None] + sorted(set(self.owner.values()))
        return ranks, [ranks.index(r) if r in ranks else 0 for r in range(self.stack.ranks)]

    def traffic(self, batch) -> CollectiveLog:
        """Every collective device 0 (pp rank 0) runs in one ``loss_and_grads``, forward and
        backward, read from the jaxpr of the loop (``jaxpr_traffic``), told which branch pp rank
        0's table row takes each tick and which of each tick's sends run; traced, not run."""
        # traced first: a fallback (``_run``) found while tracing drops the owner sums' switch
        closed = jax.make_jaxpr(self._grads)(self.state["params"], *self._args(batch))
        plan, row = self.train_plan, self.train_plan.table[0]
        choices: dict = {TICK: [int(b) for b in row[:, 0]]}
        for i, shift in enumerate(plan.shifts):
            for d, kind in enumerate("fb"):
                if shift and plan.sends[i][d]:
                    choices[f"{SEND}{shift}{kind}"] = [int(v) for v in row[:, plan.send_column(shift) + d]]
        if self.sums is not None and any(self.sums.get(OWN + k) for k in self.owner):
            choices[OWNER] = self._owner_branches()[1][0]
        return jaxpr_traffic(closed, self.atoms, choices)

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
