"""``parlay plan --devices N``: search a model's layouts on N devices, ranked by predicted step time.

A candidate is a mesh (pp, dp, a sequence axis, a tensor slot; tensor and sequence inside a node),
a strategy for each axis (dp/zero1/zero2/fsdp; tp/tp_sp/tp2d/tp2.5d/tp3d; ulysses/ring; pp with
1F1B or the interleaved schedule), the examples per microbatch, block remat and the precision.
Tens of thousands of them are costed without building or tracing their programs:

- a *unit* of the model (the GPT with 1 and with 2 layers, one example per data rank) is built and
  traced per (data, tensor, sequence, precision) on a mesh dp=2 x sequence x tensor, as ``parlay
  plan`` traces a full program (``trace_step``, ``memory_report``); the device count is not in
  the key, so 64 and 4096 devices share the traces;
- a block's FLOPs, written bytes and kept activations (with and without block remat) are the
  layers=2 trace's less the layers=1 trace's, the rest (embedding, head, loss) what is left; a
  block's collectives are those the layers=2 trace records under ``blocks.0`` (under block remat
  its forward's up to its last op that keeps a tensor run again, as torch recomputes them), the
  rest's those outside ``blocks.*``;
- a candidate scales the unit: blocks by L (a pipeline stage's: L/p), what an example carries
  (FLOPs, written bytes, activations, collectives of activations) by the examples per microbatch;
  collectives over the data axis (gradient sums, ZeRO's and FSDP's gathers) by (n-1)/n of the real
  group over the unit's, what a ring sends of a tensor of fixed size; over a data axis of 1 they go;
- a step runs m microbatches: the gradient sums once (torch defers them to the last), everything
  else m times; a pipeline's makespan is (m + (p-1)/v) times a rank's time for one microbatch
  (1F1B's v = 1 and the interleaved schedule's closed forms), its stage's input and gradient sent
  to the next and previous rank per microbatch and chunk;
- memory: parameters, gradients and AdamW's moments from the real mesh's layouts (``state_bytes``),
  a stage's L/p blocks and the rest; activations of what rank 0 holds at once: one microbatch, or
  under a pipeline min(m, p) stage-microbatches (1F1B) or 2(p-1) + (v-1)p + 1 chunks (interleaved).

tests/test_plan_search.py checks the scaled estimate against full programs' traces (bytes sent
exactly, time and memory within stated tolerances) and the closed forms against the simulator.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

from .core.cost import PROFILES, Profile, comm_time
from .core.log import CollectiveRecord
from .core.mesh import Mesh
from .core.precision import parse_precision
from .core.steps import Kind

__all__ = ["Candidate", "Estimate", "Search", "search", "print_search", "pipeline_closed_form"]

DATA = ("dp", "zero1", "zero2", "fsdp")
# tensor strategies of one axis (sized by the search) and of fixed sub-meshes (their axes, sizes and
# the axes the batch is split over besides the data axis)
TENSOR_1D = ("tp_sp", "tp")
TENSOR_ND = {"tp2d": ((("row", 2), ("col", 2)), ("row",)),
             "tp2.5d": ((("row", 2), ("col", 2), ("dep", 2)), ("row", "dep")),
             "tp3d": ((("x", 2), ("y", 2), ("z", 2)), ("y", "z"))}
SEQUENCE = ("ulysses", "ring")
# the policies searched (core/precision.py): fp16 is left out (bf16 computes as fast with no loss
# scale); bf16-sum16 is Megatron-LM's, its activation sums in bfloat16
PRECISIONS_SEARCHED = ("fp32", "bf16", "bf16-sum16")
GIB = 2 ** 30


@dataclass(frozen=True)
class Candidate:
    pp: int
    dp: int
    seq_size: int
    tensor: str | None  # tp, tp_sp (sized by tp_size), tp2d, tp2.5d, tp3d; None: no tensor parallelism
    tp_size: int
    data: str  # dp, zero1, zero2, fsdp
    seq: str | None  # ulysses, ring; None: the sequence whole
    mbs: int  # examples in one microbatch of one batch shard
    microbatches: int
    schedule: str | None  # 1f1b, interleaved; None without a pipeline
    virtual: int  # stages a pp rank runs
    remat: str  # none, block
    precision: str  # fp32, bf16, bf16-sum16 (core/precision.py)

    @property
    def tensor_axes(self) -> tuple[tuple[str, int], ...]:
        if self.tensor in TENSOR_ND:
            return TENSOR_ND[self.tensor][0]
        return (("tp", self.tp_size),) if self.tensor else ()

    @property
    def batch_ways(self) -> int:
        """The batch shards: the data axis times the tensor sub-mesh's batch axes (2D, 2.5D, 3D)."""
        extra = TENSOR_ND[self.tensor][1] if self.tensor in TENSOR_ND else ()
        return self.dp * math.prod(dict(self.tensor_axes)[a] for a in extra)

    @property
    def seq_axis(self) -> str:
        return "cp" if self.seq == "ring" else "sp"

    def mesh_axes(self, dp: int | None = None, pp: bool = True) -> list[tuple[str, int]]:
        """(pp, dp, sequence, tensor), the tensor axes innermost (consecutive ranks: one node)."""
        axes = [("pp", self.pp)] if pp and self.pp > 1 else []
        axes.append(("dp", self.dp if dp is None else dp))
        if self.seq:
            axes.append((self.seq_axis, self.seq_size))
        return axes + list(self.tensor_axes)

    @property
    def devices(self) -> int:
        return math.prod(n for _, n in self.mesh_axes())

    def strategy(self, pp: bool = True) -> str:
        parts = [self.data]
        if self.seq:
            parts.append("ring_contiguous" if self.seq == "ring" and self.pp > 1 else self.seq)
        if self.tensor:
            parts.append(self.tensor)
        if pp and self.pp > 1:
            parts.append("pp")
        return "+".join(parts)

    def mesh_text(self) -> str:
        return ",".join(f"{a}={n}" for a, n in self.mesh_axes())

    def command(self, model: str, batch: int) -> str:
        """The ``parlay plan`` (or ``run``) flags that build this candidate."""
        out = (f"--model {model} --mesh {self.mesh_text()} --strategy {self.strategy()} --batch {batch} "
               f"--microbatches {self.microbatches} --precision {self.precision} --remat {self.remat}")
        if self.schedule:
            out += f" --schedule {self.schedule} --virtual-stages {self.virtual}"
        return out


@dataclass
class Estimate:
    candidate: Candidate
    compute: float  # seconds of matrix products and the memory-bound rest (remat's recompute included)
    comm: float  # seconds of collectives (and a pipeline's sends), none overlapped
    inter: float  # of ``comm``: across nodes
    bubble: float  # seconds a pipeline rank idles
    optimizer: float
    memory: int  # predicted peak bytes on the busiest device
    state: int  # of ``memory``: parameters, gradients, AdamW's moments
    activations: int | None  # None where ``bounded``
    sent: int  # bytes rank 0 sends in a step
    flops: float  # matrix-product FLOPs rank 0 runs in a step
    fits: bool = True
    exact: bool = False  # from a unit traced at the candidate's microbatch size
    bounded: bool = False  # ``memory`` is a bound (the same layout's without remat), not counted
    why: str = ""  # why it lost to the best

    @property
    def time(self) -> float:
        return self.compute + self.comm + self.bubble + self.optimizer

    def to_json(self) -> dict:
        c = self.candidate
        return {"strategy": c.strategy(), "mesh": dict(c.mesh_axes()), "microbatches": c.microbatches,
                "examples_per_microbatch": c.mbs, "schedule": c.schedule, "virtual": c.virtual, "remat": c.remat,
                "precision": c.precision, "step_s": self.time, "compute_s": self.compute, "comm_s": self.comm,
                "comm_inter_node_s": self.inter, "bubble_s": self.bubble, "optimizer_s": self.optimizer,
                "peak_bytes": self.memory, "peak_is_bound": self.bounded, "state_bytes": self.state,
                "activation_bytes": self.activations, "sent_bytes": self.sent, "flops": self.flops,
                "fits": self.fits, "exact": self.exact, "why": self.why}


@dataclass
class _Part:
    """A block's or the rest's share of the unit, per example: FLOPs, written bytes, kept bytes
    (remat none and block), collectives (as recorded for one example per data rank)."""
    flops: float
    written: float
    kept: float
    kept_remat: float
    records: list = field(default_factory=list)


@dataclass
class _Unit:
    block: _Part
    rest: _Part
    largest: float  # bytes, per example
    inputs: float  # bytes, per example
    unit_axes: dict  # the unit mesh's axis sizes
    examples: int  # examples per batch shard the unit was traced with (its values are for that many)
    family: str  # the data strategy it was traced with: dp, or fsdp
    data_records: dict = field(default_factory=dict)  # data strategy -> (block records, rest records)


def _trace_unit(args) -> tuple:
    """In a worker process: one unit, its data strategies' collectives and remat's kept bytes."""
    model, batch, profile, memory, backend, c, datas = args
    s = Search(model, batch, profile, memory, backend)
    try:
        unit = s.unit(c)
    except ValueError as e:  # back to the parent as a plain ValueError: a subclass may not unpickle
        return ValueError(str(e)), 0
    for data in datas:
        s.data_records(replace(c, data=data), unit)
    s.remat_kept(c, unit)
    return unit, s.traces


def _split(log) -> tuple[list, list]:
    """A 2-layer unit's records: the first block's (those its remat recomputation would run again,
    the forward's before its last op that keeps a tensor, marked ``again``: planning.py counts the
    same), and the rest's (embedding, head, loss)."""
    until = log.kept.get("blocks.0", 0)
    block = [replace(r, again=not r.backward and i < until) for i, r in enumerate(log.entries)
             if r.where == "blocks.0" and r.kind is not Kind.LOCAL_SLICE]
    rest = [r for r in log.entries if not r.where.startswith("blocks.") and r.kind is not Kind.LOCAL_SLICE]
    return block, rest


def pipeline_closed_form(kind: str, p: int, m: int, v: int = 1) -> tuple[float, int]:
    """(makespan in units of one rank's time for one microbatch, the most chunks rank 0 holds)
    of 1F1B (v = 1) and Megatron's interleaved schedule with equal stage costs."""
    if kind == "1f1b":
        return m + p - 1, min(m, p)
    return m + (p - 1) / v, min(m * v, 2 * (p - 1) + (v - 1) * p + 1)


class Search:
    """The unit traces and state sizes of one model, cached; ``estimate`` costs a candidate."""

    def __init__(self, model, batch: int, profile: Profile, memory: float | None = None, backend: str = "torch"):
        from .core.models.gpt import GPT

        if not isinstance(model, GPT):
            raise ValueError(f"parlay plan --devices searches parlay's GPT (a preset or a GPT object); got "
                             f"{type(model).__name__}: the search scales a unit of repeated blocks by their count, "
                             f"which it reads from the GPT's config. Plan your own model with --mesh and --strategy.")
        self.model, self.config, self.batch, self.profile, self.backend = model, model.config, batch, profile, backend
        self.memory = memory if memory is not None else profile.memory
        if not self.memory:
            raise ValueError(f"profile {profile.name!r} gives no device memory; pass --memory GiB")
        self.units: dict = {}
        self.states: dict = {}
        self.traces = 0
        self.trace_seconds = 0.0

    # -- the unit ---------------------------------------------------------------------------------
    def _program(self, c: Candidate, layers: int, data: str, dp: int, batch: int, remat: str = "none"):
        from .core.loading import load_strategy
        from .core.models.gpt import GPT
        from .core.program import make_program

        return make_program(GPT(self.config.with_(layers=layers)), load_strategy(replace(c, data=data).strategy(False)),
                            Mesh(c.mesh_axes(dp=dp, pp=False)), batch=batch, precision=c.precision, remat=remat)

    def unit(self, c: Candidate, exact: bool = False) -> _Unit:
        """The traced unit of ``c``'s tensor, sequence and precision (data dp, or fsdp) with one example
        a batch shard, or (``exact``) with ``c``'s microbatch size; ValueError where its layouts do
        not divide the model."""
        from .core.memory import memory_report
        from .core.session import get_backend

        # dp, zero1, zero2 compute alike; fsdp gathers and writes more: its own unit when exact, else its
        # collectives from its trace and the rest from dp's
        key = self._unit_key(c, exact)
        family, examples = key[0], key[-1]
        if key in self.units:
            got = self.units[key]
            if isinstance(got, Exception):
                raise got
            return got
        t0 = time.perf_counter()
        unit = replace(c, dp=2, mbs=examples, pp=1)  # a pipeline's ring_contiguous costed as zigzag's ring
        batch = unit.batch_ways * examples
        try:
            tracer = get_backend("jax-single")
            got = {}
            for layers in (1, 2):
                prog = self._program(unit, layers, family, 2, batch)
                log, flops, written = tracer.trace_step(prog)
                got[layers] = (log, flops, written.on(self.profile), memory_report(prog, self.backend))
        except ValueError as e:
            self.units[key] = e
            raise
        (_, f1, w1, m1), (log2, f2, w2, m2) = got[1], got[2]
        block_recs, rest_recs = _split(log2)
        block = _Part(f2 - f1, w2 - w1, m2.activations - m1.activations, None, block_recs)
        rest = _Part(2 * f1 - f2, 2 * w1 - w2, 2 * m1.activations - m2.activations, None, rest_recs)
        out = _Unit(block, rest, m1.largest, m1.inputs, dict(unit.mesh_axes(pp=False)), examples, family)
        for data in ("dp", "zero1") if family == "dp" else ("fsdp",):  # the others' on first need
            out.data_records[data] = (block_recs, rest_recs)
        self.units[key] = out
        self.traces += 4
        self.trace_seconds += time.perf_counter() - t0
        return out

    def remat_kept(self, c: Candidate, unit: _Unit) -> None:
        """The unit's kept bytes under block remat (a block's, the rest's), traced on first need."""
        from .core.memory import memory_report

        if unit.block.kept_remat is None:
            t0 = time.perf_counter()
            u = replace(c, dp=2, pp=1)
            b = u.batch_ways * unit.examples
            # the embedding and head are not recomputed: they keep what they keep without remat
            one = memory_report(self._program(u, 1, unit.family, 2, b, "block"), self.backend).activations
            unit.rest.kept_remat = unit.rest.kept
            unit.block.kept_remat = one - unit.rest.kept
            self.traces += 1
            self.trace_seconds += time.perf_counter() - t0

    def data_records(self, c: Candidate, unit: _Unit) -> tuple[list, list]:
        """The unit's collectives under ``c``'s data strategy (zero2 and fsdp: traced; the others'
        forward and backward are dp's)."""
        if c.data not in unit.data_records:
            from .core.session import get_backend

            t0 = time.perf_counter()
            u = replace(c, dp=2, pp=1)
            log, _, _ = get_backend("jax-single").trace_step(self._program(u, 2, c.data, 2,
                                                                           u.batch_ways * unit.examples))
            unit.data_records[c.data] = _split(log)
            self.traces += 1
            self.trace_seconds += time.perf_counter() - t0
        return unit.data_records[c.data]

    def state(self, c: Candidate) -> tuple:
        """(the rest's, one block's) (parameters, gradients, AdamW) bytes per device on the real
        data axis, and (one block's, the rest's) optimizer-step moves (ZeRO's): the layouts and
        plans of a 1- and a 2-layer program on the real mesh, no trace."""
        from .core.memory import state_bytes
        from .core.traffic import optimizer_moves

        key = (c.data, c.tensor, c.tp_size, c.seq, c.seq_size, c.pp > 1 and c.seq == "ring", c.dp)
        if key not in self.states:
            try:
                progs = [self._program(c, n, c.data, c.dp, c.batch_ways) for n in (1, 2)]
            except ValueError as e:
                self.states[key] = e
                raise
            one, two = (state_bytes(p) for p in progs)
            moves = optimizer_moves(progs[1]).entries
            self.states[key] = (tuple(2 * a - b for a, b in zip(one, two)), tuple(b - a for a, b in zip(one, two)),
                                [r for r in moves if r.where == "blocks.0"],
                                [r for r in moves if not r.where.startswith("blocks.")])
        got = self.states[key]
        if isinstance(got, Exception):
            raise got
        return got

    def prefetch(self, cands, workers: int) -> None:
        """Trace the units ``cands`` need (their data strategies' collectives, block remat's kept
        bytes) in ``workers`` processes at once: the traces are independent and each holds a core."""
        todo: dict = {}
        for c in cands:
            key = self._unit_key(c, False)
            if key not in self.units:
                todo.setdefault(key, set()).add(c.data)
        if workers < 2 or len(todo) < 2:
            return
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        protos = {key: next(c for c in cands if self._unit_key(c, False) == key) for key in todo}
        jobs = [(protos[key], sorted(datas)) for key, datas in todo.items()]
        t0 = time.perf_counter()
        from concurrent.futures.process import BrokenProcessPool

        from .core.session import MAIN_GUARD

        try:
            with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
                for key, (unit, traces) in zip(todo, pool.map(_trace_unit, [(self.model, self.batch, self.profile,
                                                                               self.memory, self.backend, c, datas)
                                                                              for c, datas in jobs])):
                    self.units[key] = unit
                    self.traces += traces
        except BrokenProcessPool:
            raise RuntimeError(f"search(workers={workers}): a worker process died before returning (killed: out of "
                               f"memory? fewer workers need less); {MAIN_GUARD} (or pass workers=1)") from None
        self.trace_seconds += time.perf_counter() - t0

    def _unit_key(self, c: Candidate, exact: bool) -> tuple:
        examples = c.mbs if exact else 1
        family = "fsdp" if c.data == "fsdp" and exact else "dp"
        return (family, c.tensor, c.tp_size, c.seq, c.seq_size, c.precision, examples)

    # -- one candidate --------------------------------------------------------------------------
    def estimate(self, c: Candidate, memory_at_most: int | None = None, exact: bool = False) -> Estimate:
        """``c``'s predicted step; ``memory_at_most``: a bound on its memory already known (its
        twin without remat fits), so block remat's kept bytes need no trace; ``exact``: from a unit
        traced with ``c``'s microbatch size (else one example's, scaled)."""
        prof, cfg = self.profile, self.config
        unit = self.unit(c, exact)
        block_recs, rest_recs = self.data_records(c, unit)
        state_rest, state_block, moves_block, moves_rest = self.state(c)
        mesh = Mesh(c.mesh_axes())
        sizes = dict(c.mesh_axes())
        L, p, v, m, k = cfg.layers, c.pp, c.virtual, c.microbatches, c.mbs
        x = k / unit.examples  # the unit's per-example values scaled to the microbatch
        n = L // p  # blocks on a pipeline rank

        def scaled(recs, reps: float):
            """(per microbatch, once a step) records of ``reps`` copies of ``recs``."""
            micro, once = [], []
            for r in recs:
                if "dp" in r.axes:
                    g_unit = math.prod(unit.unit_axes[a] for a in r.axes)
                    g_real = math.prod(sizes.get(a, 1) for a in r.axes)
                    if g_real == 1:
                        continue
                    nbytes = r.nbytes * ((g_real - 1) / g_real) / ((g_unit - 1) / g_unit)
                    axes = tuple(a for a in r.axes if sizes.get(a, 1) > 1)
                elif r.param:
                    nbytes, axes = r.nbytes, r.axes
                else:
                    nbytes, axes = r.nbytes * x, r.axes
                rec = CollectiveRecord(r.kind, axes, round(nbytes * (reps if r.param else 1)), r.backward,
                                       r.source, r.dtype, r.where, r.param, r.again)
                (once if r.param else micro).append(rec)
            return micro, once

        b_micro, b_once = scaled(block_recs, n)
        r_micro, r_once = scaled(rest_recs, 1)
        remat = c.remat == "block"
        fwd_again = [r for r in b_micro if r.again] if remat else []  # what torch's recomputation runs again
        i_b, o_b = comm_time(mesh, b_micro + fwd_again, prof)
        i_r, o_r = comm_time(mesh, r_micro, prof)
        policy = parse_precision(c.precision)
        itemsize, dtype = policy.compute_itemsize, policy.compute
        sends = []
        if p > 1:  # a stage's output forward and its gradient back, per chunk
            shard = c.seq_size * (c.tp_size if c.tensor == "tp_sp" else 1)
            nbytes = k * cfg.seq * cfg.embed * itemsize // shard
            sends = [CollectiveRecord(Kind.PERMUTE, ("pp",), nbytes, back) for back in (False, True)] * v
        i_s, o_s = comm_time(mesh, sends, prof)
        b_once += moves_block * n  # the optimizer step's, exact
        r_once += moves_rest
        i_o, o_o = comm_time(mesh, b_once + r_once, prof)
        devices = c.devices if prof.shared else 1
        peak = prof.flops[dtype] * prof.efficiency
        flops_mb = x * (n * unit.block.flops * (4 / 3 if remat else 1) + unit.rest.flops)
        written_mb = x * (n * unit.block.written + unit.rest.written)
        compute_mb = devices * (flops_mb / peak + 2 * written_mb / prof.memory_bw)
        comm_mb = n * (i_b + o_b) + i_r + o_r + i_s + o_s
        if p > 1:
            span, held = pipeline_closed_form(c.schedule, p, m, v)
        else:
            span, held = m, 1
        per_mb = compute_mb + comm_mb
        bubble = (span - m) * per_mb
        opt_elems = (n * state_block[2] + state_rest[2]) / 8  # two float32 moments an element
        optimizer = devices * opt_elems * 4 * 4 * 2 / prof.memory_bw
        state = sum(n * b + r for b, r in zip(state_block, state_rest))
        if remat and memory_at_most is not None:
            memory, activations = memory_at_most, None
        else:
            if remat:
                self.remat_kept(c, unit)
            kept_block = unit.block.kept_remat if remat else unit.block.kept
            kept_rest = unit.rest.kept_remat if remat else unit.rest.kept
            activations = x * (held * (n / v) * kept_block + kept_rest)
            memory = state + x * m * unit.inputs + activations + x * unit.largest
        sent = m * sum(r.nbytes for r in b_micro) * n + m * sum(r.nbytes for r in r_micro + sends) \
            + sum(r.nbytes for r in b_once + r_once) + (m * n * sum(r.nbytes for r in fwd_again))
        return Estimate(c, m * compute_mb, m * comm_mb + i_o + o_o, m * (o_b * n + o_r + o_s) + o_o, bubble,
                        optimizer, round(memory), round(state), activations and round(activations), round(sent),
                        m * flops_mb, fits=memory <= self.memory, exact=unit.examples == k,
                        bounded=memory_at_most is not None and remat)

    # -- the space ------------------------------------------------------------------------------
    def candidates(self, devices: int, precision: str, tensors=("tp_sp",)) -> list[Candidate]:
        cfg, node = self.config, self.profile.node_devices
        out = []
        slots = [(None, 1)] + [(t, s) for t in tensors for s in (2, 4, 8) if s <= node] \
            + [(t, math.prod(n for _, n in TENSOR_ND[t][0])) for t in TENSOR_ND if t in tensors]
        for tensor, tsize in slots:
            for seq, ssize in [(None, 1)] + [(q, s) for q in SEQUENCE for s in (2, 4, 8)]:
                if tsize * ssize > node or devices % (tsize * ssize):
                    continue
                for p in (d for d in range(1, cfg.layers + 1) if cfg.layers % d == 0):
                    if devices % (p * tsize * ssize):
                        continue
                    dp = devices // (p * tsize * ssize)
                    for data in DATA:
                        base = Candidate(p, dp, ssize, tensor, tsize, data, seq, 1, 1, None, 1, "none", precision)
                        ways = base.batch_ways
                        if self.batch % ways:
                            continue
                        sizes = {1, 2, 4} | ({self.batch // ways} if p == 1 else set())
                        for k in sorted(sizes):
                            if self.batch % (ways * k):
                                continue
                            m = self.batch // (ways * k)
                            scheds = [("1f1b", 1)] + [("interleaved", 2)] if p > 1 else [(None, 1)]
                            for sched, v in scheds:
                                if p > 1 and (m < p or (v > 1 and (m % p or cfg.layers % (p * v)))):
                                    continue
                                for remat in ("none", "block"):
                                    out.append(replace(base, mbs=k, microbatches=m, schedule=sched, virtual=v,
                                                       remat=remat))
        return out


def search(model, devices: int, batch: int, profile: Profile | str = "h100", *, memory: float | None = None,
           precision: str | None = None, top: int = 5, refine: int = 8, workers: int = 1
           ) -> tuple[list[Estimate], list[tuple], Search]:
    """Every candidate layout of ``model`` on ``devices`` devices with a global ``batch``, best
    first (those that fit), with the reason each lost; the candidates whose layouts do not divide
    the model are returned as (candidate, reason). Structures are searched with tp_sp and the
    profile's fastest precision, float32 sums (or ``precision``); the ``refine`` best are then
    tried with tp, 2D/2.5D/3D tensor parallelism and each of ``PRECISIONS_SEARCHED`` too. The first pass's units are traced in
    ``workers`` processes (spawned: a script calling this with ``workers`` > 1 needs the
    ``if __name__ == "__main__":`` guard; ``parlay plan`` uses the cores, at most 4)."""
    profile = PROFILES[profile] if isinstance(profile, str) else profile
    s = Search(model, batch, profile, memory)
    fast = max(("fp32", "bf16"), key=lambda q: profile.flops[parse_precision(q).compute]) \
        if precision is None else precision
    estimates, invalid, seen = [], [], set()

    def run(cands):
        done = {}
        for c in sorted(cands, key=lambda c: c.remat != "none"):  # each layout without remat first
            if c in seen:
                continue
            seen.add(c)
            twin = done.get(replace(c, remat="none"))
            try:
                e = s.estimate(c, twin.memory if c.remat != "none" and twin is not None and twin.fits else None)
            except ValueError as err:
                invalid.append((c, str(err).splitlines()[-1].strip(" -")))
                continue
            done[c] = e
            estimates.append(e)

    first = s.candidates(devices, fast)
    s.prefetch(first, workers)
    run(first)
    best = sorted((e for e in estimates if e.fits), key=lambda e: e.time)[:refine]
    precisions = PRECISIONS_SEARCHED if precision is None else (precision,)
    variants = []
    for e in best:
        c = e.candidate
        for tensor in (c.tensor, "tp") if c.tensor == "tp_sp" else (c.tensor,):
            variants += [replace(c, tensor=tensor, precision=q) for q in precisions]
    # the 2D/2.5D/3D slots at the best candidates' pipeline and data choices
    for e in best[:2]:
        c = e.candidate
        for t, (axes, _) in TENSOR_ND.items():
            size = math.prod(n for _, n in axes)
            inner = size * c.seq_size
            if devices % (c.pp * inner) or inner > profile.node_devices:
                continue
            alt = replace(c, tensor=t, tp_size=size, dp=devices // (c.pp * inner))
            ways = alt.batch_ways
            if batch % (ways * c.mbs):
                continue
            m = batch // (ways * c.mbs)
            if c.pp > 1 and (m < c.pp or (c.virtual > 1 and m % c.pp)):
                continue
            variants.append(replace(alt, microbatches=m))
    run(variants)
    # the leaders again from units traced at their own microbatch size (the scaled written bytes,
    # largest value and activations are estimates); until the first ``top`` are all exact
    exact: set = set()

    def costed_exactly(todo):
        for e in todo:
            exact.add(e.candidate)
            estimates[estimates.index(e)] = s.estimate(e.candidate, exact=True)

    while True:
        leaders = [e for e in sorted(estimates, key=lambda e: e.time) if e.fits][:max(top, 1)]
        todo = [e for e in leaders if e.candidate not in exact]
        if not todo:
            break
        costed_exactly(todo)
    # the best of each group of losers (what print_search shows for why they lost) exact too, a
    # few rounds (an exact cost may move a layout to another group)
    for _ in range(3):
        ranked = sorted(estimates, key=lambda e: (not e.fits, e.time))
        explain(ranked)
        shown = {}
        for e in ranked[1:]:
            shown.setdefault(_group(e), e)
        todo = [e for e in shown.values() if e.fits and e.candidate not in exact]
        if not todo:
            break
        costed_exactly(todo)
    ranked = sorted(estimates, key=lambda e: (not e.fits, e.time))
    explain(ranked)
    return ranked, invalid, s


def explain(ranked: list[Estimate]) -> None:
    """Each estimate's ``why``: does not fit, or the term by which it is slowest against the best."""
    if not ranked:
        return
    best = ranked[0]
    for e in ranked[1:]:
        if not e.fits:
            e.why = f"does not fit: {_size(e.memory)}"
            continue
        deltas = {"bubble": e.bubble - best.bubble, "traffic": e.comm - best.comm,
                  "compute": e.compute - best.compute, "optimizer": e.optimizer - best.optimizer}
        term = max(deltas, key=deltas.get)
        if e.time - best.time <= 1e-3 * best.time:
            e.why = f"ties (within 0.1%: {1e3 * (e.time - best.time):+.2f} ms)"
            continue
        words = {"bubble": "bubble", "traffic": "more traffic", "compute": "more compute",
                 "optimizer": "slower optimizer step"}[term]
        e.why = f"{words} (+{1e3 * deltas[term]:.2f} ms)"


def _group(e: Estimate) -> str:
    """The reason ``e`` lost, without its figures: "more traffic", "does not fit", ..."""
    return e.why.split(" (")[0].split(":")[0]


def _size(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB / 10 else f"{n / 2 ** 20:.1f} MiB"


def print_search(ranked, invalid, s: Search, console, top: int, seconds: float, model: str) -> None:
    from rich.table import Table

    fit = [e for e in ranked if e.fits]
    console.print(f"searched {len(ranked) + len(invalid)} layouts of {model} on {ranked[0].candidate.devices if ranked else '?'} "
                  f"{s.profile.name} devices (batch {s.batch}, memory {s.memory / GIB:.1f} GiB each) in {seconds:.1f} s "
                  f"({s.traces} unit traces, {s.trace_seconds:.1f} s): {len(fit)} fit", soft_wrap=True)
    if not fit:
        console.print(f"none fits: the smallest needs {_size(min(e.memory for e in ranked))}; pass --memory, use more "
                      f"devices or a smaller batch" if ranked else "no layout divides the model: "
                      + (invalid[0][1] if invalid else "no mesh of these devices"), soft_wrap=True)
        return
    table = Table(title="best layouts (predicted, nothing overlapped)", title_justify="left")
    for col in ("#", "strategy", "mesh", "micro", "schedule", "remat", "prec", "step ms", "comm", "bubble", "peak"):
        table.add_column(col, justify="left" if col in ("strategy", "mesh", "schedule", "remat", "prec") else "right")
    for i, e in enumerate(fit[:top]):
        c = e.candidate
        table.add_row(str(i + 1), c.strategy(), c.mesh_text(), f"{c.microbatches}x{c.mbs}",
                      f"{c.schedule} v{c.virtual}" if c.schedule == "interleaved" else c.schedule or "-", c.remat,
                      c.precision, f"{1e3 * e.time:.2f}", f"{1e3 * e.comm:.2f}", f"{1e3 * e.bubble:.2f}",
                      ("<=" if e.bounded else "") + _size(e.memory))
    console.print(table)
    groups: dict[str, list[Estimate]] = {}
    for e in ranked[1:]:
        groups.setdefault(_group(e), []).append(e)
    why = Table(title="why the others lost (against #1; the best of each group)", title_justify="left")
    for col in ("reason", "layouts", "the best of them", "its step or peak"):
        why.add_column(col)
    for reason, group in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        e = min(group, key=lambda e: e.time if e.fits else e.memory)
        c = e.candidate
        what = f"{c.strategy()} {c.mesh_text()} {c.microbatches}x{c.mbs} {c.schedule or ''} {c.remat} {c.precision}"
        figure = f"{1e3 * e.time:.2f} ms" if e.fits else _size(e.memory)
        why.add_row(reason, str(len(group)), what, f"{figure}: {e.why}")
    if invalid:
        ex = invalid[0]
        why.add_row("does not divide", str(len(invalid)), f"{ex[0].strategy()} {ex[0].mesh_text()}", ex[1][:80])
    console.print(why)
