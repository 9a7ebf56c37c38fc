"""``parlay plan --check`` (backends/jax/plan_check.py): the plan's collective bytes against the
optimized HLO of the same program compiled on JAX explicit, and its memory against XLA's
``memory_analysis()``; its collectives against JAX explicit's jaxpr, exactly. Nothing runs; each case compiles two functions (about 2 s).

For the data-parallel, 1D, 2D and 3D tensor-parallel and sequence-parallel strategies the bytes
are equal kind by kind (up to the ring formula's rounding); ring attention's permutes are the one
known difference, pinned below.
benchmarks/plan_check.py prints every built-in strategy in fp32 and bf16.
"""

import pytest

from parlay.backends.jax.plan_check import check_plan
from parlay.core import Mesh
from parlay.core.program import program_from
from parlay.planning import plan_report


def _check(strategy, axes, **kw):
    return check_plan(plan_report(program_from("tiny", strategy, Mesh(axes), batch=8, **kw), "jax"))


@pytest.mark.parametrize("strategy,axes", [
    ("dp", dict(dp=4)), ("zero1", dict(dp=4)), ("fsdp", dict(dp=4)), ("tp_sp", dict(tp=4)),
    ("fsdp+tp", dict(dp=2, tp=2)), ("tp2d", dict(row=2, col=2)),
    pytest.param("tp2.5d", dict(row=2, col=2, dep=2), marks=pytest.mark.exhaustive),
    pytest.param("zero2", dict(dp=4), marks=pytest.mark.exhaustive),
    pytest.param("tp", dict(tp=4), marks=pytest.mark.exhaustive),
    pytest.param("dp+tp", dict(dp=2, tp=2), marks=pytest.mark.exhaustive),
])
def test_the_plan_sends_the_bytes_xla_compiles(strategy, axes):
    """Every kind's bytes equal in the forward and backward and in the optimizer step. tp_sp's row
    failed before the loss's max all-reduce was counted (768 bytes short); tp2d's before the
    executor moved one activation once for q, k and v (XLA merged the copies torch sent)."""
    check = _check(strategy, axes)
    assert check.rows and check.equal, [r for r in check.rows if not r.equal]
    assert check.jax_rows and check.jax_equal, check.jax_rows  # and JAX explicit's jaxpr, exactly
    assert {r.kind for r in check.rows if r.phase == "fwd+bwd"} >= {"all-reduce"}
    predicted, xla = check.peak
    assert abs(predicted / xla - 1) <= 0.15, check.to_json()["peak"]


def test_microbatches_count_the_whole_step_on_both_sides():
    """k microbatches: the plan counts each one's forward and backward and the gradients' sums
    once; the HLO's accumulation loop runs its body its known trip count times, the sums after it
    (JAX explicit varies each parameter once, before the loop). Before the trip count was read,
    the HLO side counted the body once (dp=2 x tp=4, k=2: 313,156 bytes against the plan's 510,344);
    here dp=2 x tp=2, k=4."""
    check = _check("dp+tp", dict(dp=2, tp=2), microbatches=4)
    assert check.equal and check.jax_equal, (check.rows, check.jax_rows)
    (row,) = [r for r in check.rows if r.kind == "all-reduce"]
    single = next(r for r in _check("dp+tp", dict(dp=2, tp=2)).rows if r.kind == "all-reduce")
    assert single.plan_bytes < row.plan_bytes < 4 * single.plan_bytes  # the sums once, the rest 4 times


@pytest.mark.parametrize("strategy,axes", [("ulysses", dict(sp=4)), ("ring", dict(cp=4)),
                                           pytest.param("tp3d", dict(x=2, y=2, z=2), marks=pytest.mark.exhaustive)])
def test_a_shared_slice_gathers_its_gradient_on_jax(strategy, axes):
    """Ulysses and ring slice the position table per sequence block, tp3d slices q, k and h where
    every rank of x holds them. Torch all-gathers the gradient's blocks, as the plan counts; JAX
    transposed such a slice to a sum of the zero-padded gradient (twice the bytes, an all-reduce)
    until ``JaxComm.slice_shared`` gave it the all-gather. Ring's permutes are the one known
    difference: XLA keeps the forward's rotated K and V for the backward, where torch (and the
    plan) sends them around the ring again. JAX explicit's own program (its jaxpr, before XLA)
    sends them again too: equal to the plan there, permutes included."""
    check = _check(strategy, axes)
    assert check.jax_equal, check.jax_rows
    rows = {r.kind: r for r in check.rows}
    assert rows["all-gather"].plan_bytes > 0 and rows["all-gather"].equal and rows["all-reduce"].equal
    assert all(r.equal for k, r in rows.items() if k != "permute" or strategy != "ring"), rows
    if strategy == "ring":
        assert 0 < rows["permute"].xla_bytes < rows["permute"].plan_bytes


def test_parlay_plan_check_prints_and_writes_it(tmp_path, capsys):
    import json

    from parlay.cli import main

    path = tmp_path / "plan.json"
    assert main(["plan", "--strategy", "tp_sp", "--mesh", "tp=2", "--check", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "the plan against XLA's compiled step" in out and "equal" in out and "memory_analysis" not in out
    assert "the plan against JAX explicit's program" in out
    check = json.loads(path.read_text())["check"]
    assert all(r["equal"] for r in check["collectives"]) and check["peak"]["xla_total"] > 0
    assert check["jax_explicit"] and all(r["equal"] for r in check["jax_explicit"])
    assert {r["phase"] for r in check["jax_explicit"]} == {"forward", "backward"}
    # a pipeline: JAX's tick loop read told pp rank 0's row, against JAX's plan of it; no HLO rows
    assert main(["plan", "--strategy", "pp+dp", "--mesh", "pp=2,dp=4", "--microbatches", "2", "--check", "--json",
                 str(path)]) == 0
    out = capsys.readouterr().out
    assert "a pipeline runs as JAX's tick loop" in out and "the plan against XLA's compiled step" not in out
    check = json.loads(path.read_text())["check"]
    assert not check["hlo_compared"] and not check["collectives"] and check["peak"]["xla_total"] > 0
    rows = {(r["phase"], r["kind"], tuple(r["axes"])): r for r in check["jax_explicit"]}
    assert set(rows) == {("forward", "permute", ("pp",)), ("backward", "all-reduce", ("dp",))}, rows
    assert all(r["equal"] for r in rows.values()) and rows["forward", "permute", ("pp",)]["jax"][0] == 2
    assert main(["plan", "--devices", "8", "--check"]) == 2
    assert "with --devices N the search prints the command" in capsys.readouterr().err
