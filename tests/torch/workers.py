"""Functions run on spawned gloo ranks by the torch tests (module-level, so spawn can import them)."""

import os
import time

import numpy as np
import torch
import torch.distributed as dist

from parlay import Mesh
from parlay.backends.torch.session import TorchSession
from parlay.core.executor import Fault, Hooks
from parlay.core.models.gpt import GPT, PRESETS
from parlay.core.program import make_program
from sharded_case import run_case


def batch(config, seed=0, n=8):
    tokens = np.random.default_rng(seed).integers(0, config.vocab, (n, config.seq + 1)).astype(np.int32)
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}


def _key(strategy, axes) -> str:
    return strategy + "@" + ",".join(f"{a}={n}" for a, n in axes)


def loss_and_grads(rank, preset, cases, bucket_bytes=None, coalesce=False):
    """For each (strategy, mesh axes): loss, global grads, forward and backward collective counts."""
    model = GPT(PRESETS[preset])
    params, b = model.init(0), batch(model.config)
    return {_key(strategy, axes): run_case(rank, model, params, b, strategy, axes, bucket_bytes=bucket_bytes,
                                           coalesce=coalesce)
            for strategy, axes in cases}


def all_strategies(rank, preset, cases, settings):
    """Every (strategy, mesh) under every (bucket_bytes, coalesce) setting, in one spawn: loss,
    global grads, forward and backward collective counts, keyed "strategy@mesh/bucket,coalesce"."""
    from model_params import params_for

    model = GPT(PRESETS[preset])
    params, b = params_for(model), batch(model.config)
    return {f"{_key(strategy, axes)}/{bucket_bytes},{coalesce}":
            run_case(rank, model, params, b, strategy, axes, bucket_bytes=bucket_bytes, coalesce=coalesce)
            for bucket_bytes, coalesce in settings for strategy, axes in cases}


def die_mid_step(rank, dead_rank):
    """Every rank all-reduces; one exits first, so the others wait on a peer that is gone."""
    if rank == dead_rank:
        time.sleep(0.5)
        os._exit(3)
    t = torch.ones(4)
    dist.all_reduce(t)
    return float(t.sum())


def train_steps(rank, preset, cases, steps):
    """Losses of `steps` AdamW steps and the final global parameters, per strategy."""
    model = GPT(PRESETS[preset])
    params, b = model.init(0), batch(model.config)
    out = {}
    for strategy, axes in cases:
        session = TorchSession(make_program(model, strategy, Mesh(dict(axes)), batch=8), params)
        losses = [session.step(b) for _ in range(steps)]
        final = session.params()
        shards = {k: tuple(m.shape) for k, m in session.master.items()}
        names = [n for n, _ in session.module.named_parameters()]
        assert names == list(model.param_shapes()), names[:3]
        assert all(isinstance(p, torch.nn.Parameter) for p in session.module.parameters())
        out[strategy] = (losses, final if rank == 0 else None, shards)
    return out


def dtensor_round_trips(rank):
    """parlay layouts -> DTensor -> full tensor and back, and DTensor's own redistribution."""
    from torch.distributed.tensor import Replicate, Shard

    from parlay import Layout, P, scatter
    from parlay.backends.torch.dtensor import from_dtensor, layout_of, to_dtensor
    from parlay.backends.torch.mesh import TorchMesh

    mesh = Mesh(dp=2, tp=2)
    tm = TorchMesh(mesh)
    x = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
    out = []
    for layout in [Layout(mesh, P("dp", "tp")), Layout(mesh, P(("dp", "tp"))), Layout(mesh, P(None, "tp")),
                   Layout(mesh, P("tp"), partial="dp")]:
        local = torch.from_numpy(scatter(x, layout, rng=0)[rank])
        dt = to_dtensor(local, layout, tm.device_mesh, x.shape)
        full = dt.full_tensor().numpy()
        back_local, back = from_dtensor(dt, mesh)
        moved = dt.redistribute(tm.device_mesh, [Replicate(), Shard(1)])
        # Partial: float addends sum back to x up to rounding (values < 100, fp32).
        out.append((str(layout), np.allclose(full, x, rtol=0, atol=1e-4), back == layout, torch.equal(back_local, local),
                    from_dtensor(moved, mesh)[1] == Layout(mesh, P(None, "tp"))))
    try:
        to_dtensor(torch.zeros(2, 12), Layout(mesh, P(("tp", "dp"))), tm.device_mesh, x.shape)
        out.append("no error")
    except ValueError as e:
        out.append(str(e))
    try:
        layout_of([Shard(0), Replicate()], mesh, (7, 4))
        out.append("no error")
    except ValueError as e:
        out.append(str(e))
    return out


def plan_bytes_vs_wrapper(rank, cases):
    """Forward of one step: what the executed plans say this rank sends (kind, axes, count,
    bytes) against what the collective wrapper saw go out."""
    from parlay.core import Kind

    model = GPT(PRESETS["tiny-gqa"])
    params, b = model.init(0), batch(model.config)
    out = {}
    for strategy, axes in cases:
        session = TorchSession(make_program(model, strategy, Mesh(dict(axes)), batch=8), params, coalesce=False)
        plans: list = []
        session.hooks = Hooks(plans=plans)
        session.log.clear()
        session.loss(b)
        planned, counts = 0, {}
        for plan in plans:
            for step, sent in zip(plan.steps, plan.step_bytes):
                planned += sent[rank]
                if step.kind is not Kind.LOCAL_SLICE:
                    key = (step.kind, getattr(step, "axes", ()))
                    counts[key] = counts.get(key, 0) + 1
        out[strategy] = (planned, session.log.bytes(backward=False, source="plan"), counts,
                         session.log.counts(backward=False, source="plan"))
    return out


def planted_bisect(rank, layer, b):
    """The torch recording with one layer's forward all-reduces dropped (a planted bug)."""
    model = GPT(PRESETS["tiny"])
    program = make_program(model, "dp+tp", Mesh(dp=2, tp=2), batch=8).replace(fault=Fault("drop-all-reduce", layer))
    return TorchSession(program, model.init(0)).trace(b)


def tied_table_two_paths(rank):
    """A tied table whose first use is as stored (its gradient goes straight to its sharded
    gradient layout) and whose second use is sliced first (its gradient reaches autograd): the
    rule set the differential test found, on 8 ranks."""
    from parlay import Rules
    from parlay.core.strategies import Strategy
    from model_params import params_for

    strategy = Strategy("found", params=Rules([("seq", "y")]),
                        activations=Rules([("embed", "y"), ("batch", "x")]), grads=Rules([("embed", ("x", "y"))]))
    model = GPT(PRESETS["tiny-gpt2-hf"])
    session = TorchSession(make_program(model, strategy, Mesh(x=2, y=2), batch=8), params_for(model))
    return session.loss_and_grads(batch(model.config))


def ring_ops(rank, cases):
    """Ring attention's forward and backward on this rank's blocks (tests/ring_cases.py), and the
    bytes its shifts sent forward and backward."""
    import ring_cases as rc
    from parlay.backends.torch.comm import TorchComm
    from parlay.backends.torch.mesh import TorchMesh
    from parlay.backends.torch.ops import TorchLocal
    from parlay.core.log import CollectiveLog

    out = {}
    for case in cases:
        log = CollectiveLog()
        comm = TorchComm(TorchMesh(Mesh(case[0])), TorchLocal(), log=log)
        xs = [torch.from_numpy(rc.block(case, x, rank)) for x in rc.arrays(case)]
        res = rc.local_run(comm.local, comm, case, *xs)
        out[rc.key(case)] = ([r.numpy() for r in res], log.bytes(backward=False, source="plan"),
                             log.bytes(backward=True, source="plan"))
    return out


def traffic_counts(entries) -> dict:
    """Log entries as {(kind, axes, backward, source): (count, bytes)}, local slices left out."""
    seen: dict = {}
    for e in entries:
        if e.kind.value != "local-slice":
            key = (e.kind.value, e.axes, e.backward, e.source.value)
            c, n = seen.get(key, (0, 0))
            seen[key] = (c + 1, n + e.nbytes)
    return seen


def pipeline_traffic(rank, cases):
    """For each (preset, layers, strategy, mesh axes, schedule, microbatches[, remat]): what this
    rank sent in one training step of its microbatches (a pipeline's or not), with a gradient bucket
    per parameter (each sum its own record, sent once the step's last microbatch is back, as by
    default), keyed by (preset, layers, strategy, schedule, remat)."""
    out = {}
    for preset, layers, strategy, axes, schedule, m, *remat in cases:
        remat = (remat or ["none"])[0]
        model = GPT(PRESETS[preset].with_(layers=layers))
        program = make_program(model, strategy, Mesh(dict(axes)), batch=8, microbatches=m, schedule=schedule,
                               remat=remat)
        session = TorchSession(program, model.init(0), coalesce=False, bucket_bytes=1)
        session.step(batch(model.config))
        out[preset, layers, strategy, schedule, remat] = traffic_counts(session.log.entries)
    return out


def step_traffic(rank, preset, cases):
    """For each (strategy, mesh axes[, make_program's options]): what this rank sent in one training
    step (forward, backward and the optimizer step's moves; no gradient buckets, so each parameter's
    sum is its own record), as ``traffic_counts``, keyed by ``_key`` and the options' items."""
    model = GPT(PRESETS[preset])
    params, b = model.init(0), batch(model.config)
    out = {}
    for strategy, axes, *options in cases:
        options = (options or [{}])[0]
        program = make_program(model, strategy, Mesh(dict(axes)), batch=8, **options)
        session = TorchSession(program, params, coalesce=False, bucket_bytes=None)
        session.step(b)  # clears the log first: this step's collectives only
        out[_key(strategy, axes), *sorted(options.items())] = traffic_counts(session.log.entries)
    return out
