"""``parlay plan`` (planning.py): one training step's collectives per layer and in total, its
memory and a pipeline's bubble, before anything runs. That the collectives are what torch sends
is tests/torch/test_traffic.py; here: the command, its JSON, and the report's own sums."""

import json

import pytest

from hypothesis import HealthCheck, given, settings

from differential_cases import cases, describe, inputs, program
from parlay.cli import main
from parlay.core import Mesh
from parlay.core.memory import memory_report
from parlay.core.program import program_from
from parlay.planning import PHASES, plan_report


def test_the_report_adds_up_and_names_each_layer():
    program = program_from("tiny", "zero1+tp", Mesh(dp=2, tp=4), batch=8)
    report = plan_report(program)
    layers = [layer for layer, _ in report.by_layer()]
    assert layers == ["embed", "blocks.0", "blocks.1", "final_norm", "lm_head"]  # the model's order
    for phase in PHASES:
        assert sum(row.get(phase, (0, 0))[1] for _, row in report.by_layer()) == report.sent(phase)
        assert sum(row.get(phase, (0, 0))[1] for *_, row in report.by_kind()) == report.sent(phase)
    # ZeRO-1: the optimizer step all-gathers each parameter's updated shard over dp, nothing else.
    assert {(k, a) for k, a, row in report.by_kind() if "optimizer" in row} == {("all-gather", ("dp",))}
    # the gradient's dp sum per parameter in the backward: 2 (P-1)/P of each parameter's block
    bwd_dp = next(row["backward"] for k, a, row in report.by_kind() if (k, a) == ("all-reduce", ("dp",)))
    assert bwd_dp[0] == len(program.shapes)
    assert bwd_dp[1] == sum(2 * (2 - 1) * 4 * n // 2 for n in (
        __import__("math").prod(program.layouts[__import__("parlay").core.Role.PARAMS][k].local_shape(s))
        for k, s in program.shapes.items()))
    assert report.memory == memory_report(program)


def test_parlay_plan_prints_and_writes_its_report(tmp_path, capsys):
    path = tmp_path / "plan.json"
    assert main(["plan", "--strategy", "fsdp+tp_sp", "--mesh", "dp=2,tp=4", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "collectives per layer" in out and "blocks.0-1 (each)" in out and "by kind and mesh axes" in out
    assert "memory per device (predicted)" in out and "one all-reduce of 8 B (float64) over all 8 ranks" in out
    data = json.loads(path.read_text())
    report = plan_report(program_from("tiny", "fsdp+tp_sp", Mesh(dp=2, tp=4), batch=8))
    assert data["sent_bytes"] == {**{ph: report.sent(ph) for ph in PHASES}, "total": report.sent()}
    assert len(data["collectives"]["backward"]) == len(report.records["backward"])
    assert data["memory"]["peak"] == report.memory.peak and data["bubble"] is None


def test_a_pipeline_reports_its_bubble_and_says_what_it_does_not_count(capsys):
    assert main(["plan", "--strategy", "pp", "--mesh", "pp=2", "--microbatches", "4"]) == 0
    out = capsys.readouterr().out
    assert "bubble 20.0% of a step" in out  # (p-1)/(m+p-1) = 1/5 for 1F1B
    assert "the loss's mean over pp" in out  # the one collective it leaves out, said so
    assert "permute" in out  # the stage's output to the next pp rank


def test_bad_plan_flags(capsys):
    assert main(["plan", "--strategy", "tp", "--mesh", "tp=3"]) == 2
    assert "not divisible by 3" in capsys.readouterr().err
    assert main(["plan", "--strategy", "dp", "--mesh", "dp=2", "--steps", "3"]) == 2  # plan runs nothing
    assert "unrecognized arguments: --steps 3" in capsys.readouterr().err


def _jax_rows(program, batch):
    from parlay.backends.jax.plan_check import traffic_rows
    from parlay.core import get_backend

    log = get_backend("jax").run(program, lambda session: session.traffic(batch))
    return traffic_rows(plan_report(program).records, log, program.mesh)


def _differ(rows):
    return [row for row in rows if row[3:5] != row[5:7]]


def test_the_plan_is_what_jax_explicit_runs():
    # Every collective of JAX explicit's loss and gradients, forward and backward, read from the
    # jaxpr it runs (its backward is JAX's transpose, which no parlay code writes down), equals the
    # plan's by phase, kind and mesh axes, in count and bytes: for every built-in strategy but pp,
    # in bf16 and bf16-sum16 and under remat (the cases tests/torch/test_traffic.py checks against
    # torch's log; a recomputation's collectives run in the backward on both sides).
    import sys
    from pathlib import Path

    import numpy as np

    from parlay.core.models.gpt import GPT, PRESETS
    from parlay.core.program import make_program

    sys.path.insert(0, str(Path(__file__).parent / "torch"))
    from test_traffic import CASES, OPTIONS

    model = GPT(PRESETS["tiny"])
    tokens = np.random.default_rng(0).integers(0, 256, (8, model.config.seq)).astype("int32")
    batch = {"tokens": tokens, "targets": tokens}
    for strategy, axes, *options in CASES + OPTIONS:
        program = make_program(model, strategy, Mesh(dict(axes)), batch=8, **(options or [{}])[0])
        rows = _jax_rows(program, batch)
        assert {row[0] for row in rows} == {"forward", "backward"}, strategy
        assert not _differ(rows), (strategy, options, _differ(rows))
    # k microbatches: each one's forward and backward, the parameters' gradient sums once (JAX
    # explicit varies each parameter once, before its microbatch loop; torch's buckets wait).
    for strategy, axes, k, remat in (("zero1+tp", dict(dp=4, tp=2), 2, "none"), ("dp+tp", dict(dp=2, tp=4), 4, "block")):
        program = make_program(model, strategy, Mesh(axes), batch=8, microbatches=k, remat=remat)
        assert not _differ(_jax_rows(program, batch)), (strategy, _differ(_jax_rows(program, batch)))


@pytest.mark.slow
def test_the_plan_is_what_the_jax_tick_loop_runs():
    # JAX's pipeline is one compiled tick loop: device 0 (pp rank 0) runs the branch its table row
    # names each tick and the sends of that tick it takes part in. Read from the loop's jaxpr,
    # told those choices, its collectives equal the plan's for JAX (``plan_report(..., "jax")``:
    # each backward piece runs its stage's forward again; each parameter's gradient summed once a
    # step, after the loop; only the stage outputs and input gradients the schedule sends), by
    # phase, kind and axes, in count and bytes: the pipelines torch's log is checked on
    # (tests/torch/test_traffic.py), 1F1B, interleaved, ZB-V, a tied table, remat.
    import sys
    from pathlib import Path

    import numpy as np

    from parlay.backends.jax.plan_check import traffic_rows
    from parlay.core import get_backend
    from parlay.core.models.gpt import GPT, PRESETS
    from parlay.core.program import make_program

    sys.path.insert(0, str(Path(__file__).parent / "torch"))
    from test_traffic import PIPELINES

    for preset, layers, strategy, axes, schedule, m, *remat in PIPELINES:
        if schedule is None:
            continue
        model = GPT(PRESETS[preset].with_(layers=layers))
        program = make_program(model, strategy, Mesh(dict(axes)), batch=8, microbatches=m, schedule=schedule,
                               remat=(remat or ["none"])[0])
        tokens = np.random.default_rng(0).integers(0, model.config.vocab, (8, model.config.seq)).astype("int32")
        log = get_backend("jax").run(program, lambda session: session.traffic({"tokens": tokens, "targets": tokens}))
        rows = traffic_rows(plan_report(program, "jax").records, log, program.mesh)
        sends = {row[0] for row in rows if row[1] == "permute" and row[5]}  # rank 0's, back from a later stage
        assert sends == {"forward"} | ({"backward"} if max(program.pipeline.schedule.stages_of(0)) else set()), rows
        assert not _differ(rows), (strategy, schedule, remat, _differ(rows))
        if model.config.tie_embeddings:  # the tied table's gradient, summed over pp once
            assert ("backward", "all-reduce", ("pp",), 1) == rows[[r[:3] for r in rows].index(
                ("backward", "all-reduce", ("pp",)))][:4], rows


def test_the_backward_is_read_from_jaxs_transpose_not_from_a_scopes_name():
    # A user's scope named "transpose_heads" around a forward collective stays forward; the
    # gradient of a value made to vary (pcast) is the backward's sum.
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from parlay.backends.jax.jaxpr_traffic import jaxpr_traffic
    from parlay.backends.jax.mesh import AtomMesh

    atoms = AtomMesh(Mesh(dp=2))

    def local(x, w):
        with jax.named_scope("transpose_heads"):
            return jax.lax.psum(x * jax.lax.pcast(w, ("dp",), to="varying"), "dp")

    f = jax.shard_map(local, mesh=atoms.jax_mesh(None), in_specs=(P("dp"), P()), out_specs=P())
    closed = jax.make_jaxpr(jax.grad(lambda x, w: f(x, w).sum(), argnums=1))(jnp.ones(4), jnp.ones(2))
    assert [(e.kind.value, e.axes, e.nbytes, e.backward) for e in jaxpr_traffic(closed, atoms).entries] == [
        ("all-reduce", ("dp",), 8, False), ("all-reduce", ("dp",), 8, True)]


def test_a_conds_branch_is_the_one_device_0_takes_trip_by_trip():
    # A scan of 3 trips whose switch (in scope "pick") runs a psum over dp (branch 1) or a send
    # over dp (branch 2, a p2p scope) or nothing (0): told device 0's branch per trip, the reader
    # counts exactly those; a send device 0 only receives is not its record; untold, it refuses.
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from parlay.backends.jax.jaxpr_traffic import P2P, jaxpr_traffic
    from parlay.backends.jax.mesh import AtomMesh

    atoms = AtomMesh(Mesh(dp=2))
    perms = {2: [(0, 1)], 3: [(1, 0)]}  # device 0 sends; device 0 only receives

    def local(x, which):
        def tick(c, i):
            with jax.named_scope("pick"):
                moves = [lambda v: v, lambda v: jax.lax.psum(v, "dp")]
                for k in (2, 3):
                    def send(v, perm=perms[k]):
                        with jax.named_scope(P2P + "x"):
                            return jax.lax.ppermute(v, "dp", perm)
                    moves.append(send)
                return jax.lax.switch(i, moves, c), None
        return jax.lax.scan(tick, x, which)[0]

    f = jax.shard_map(local, mesh=atoms.jax_mesh(None), in_specs=(P("dp"), P()), out_specs=P("dp"), check_vma=False)
    closed = jax.make_jaxpr(f)(jnp.ones(8), jnp.zeros(4, jnp.int32))
    got = lambda trips: [(e.kind.value, e.nbytes, e.source.value)
                         for e in jaxpr_traffic(closed, atoms, {"pick": trips}).entries]
    assert got([1, 0, 2, 3]) == [("all-reduce", 16, "plan"), ("permute", 16, "p2p")]  # 4 floats a device
    assert got([0, 0, 3, 3]) == []
    with pytest.raises(ValueError, match="branches of a cond run different collectives"):
        jaxpr_traffic(closed, atoms)
    with pytest.raises(ValueError, match="has 2 choices for a scan of 4 trips"):
        jaxpr_traffic(closed, atoms, {"pick": [0, 1]})


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=cases())
def test_the_plan_is_what_jax_explicit_runs_on_random_rule_sets(case):
    # Random rule sets on random meshes (up to 8 ranks, parts of axes) and models that are not
    # the GPT (a ViT, an MLP): the plan's collectives are JAX explicit's, exactly.
    params, batch = inputs(case[0])
    rows = _jax_rows(program(case), batch)
    assert not _differ(rows), (describe(case), _differ(rows))
