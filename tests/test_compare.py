"""parlay compare: agreement on every backend, a planted wrong collective caught, bad flags."""

import json

import numpy as np
import pytest

from parlay.cli import main


def test_compare_agrees_and_writes_the_report(tmp_path, capsys):
    path = tmp_path / "r.json"
    plot = tmp_path / "plots" / "c.png"
    argv = ["compare", "--model", "tiny", "--mesh", "dp=2,tp=2", "--strategy", "fsdp+tp", "--steps", "2",
            "--json", str(path), "--plot", str(plot)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "reference (1 device)" in out and "agree" in out and f"plot written to {plot}" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000
    report = json.loads(path.read_text())
    assert set(report["backends"]) == {"torch", "jax", "jax-gspmd", "numpy"}
    for run in report["backends"].values():
        assert len(run["losses"]) == 2 and run["agree"]
        assert run["param_rel_diff"] <= report["tolerance"]["param"]
    assert report["reference"]["losses"][1] < report["reference"]["losses"][0]


def test_a_dropped_all_reduce_makes_compare_exit_1_and_the_bisect_names_it(capsys, tmp_path):
    """The fault, planted in the one sharded executor: its forward all-reduces in blocks.1.mlp
    return their input, on JAX explicit and on the numpy simulator alike (GSPMD's collectives
    are XLA's: unaffected)."""
    path = tmp_path / "r.json"
    argv = ["compare", "--model", "tiny", "--mesh", "tp=2", "--strategy", "tp", "--steps", "2",
            "--backends", "jax,numpy,jax-gspmd", "--plot", "", "--json", str(path), "--drop-all-reduce", "blocks.1.mlp"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "NO" in out and "jax disagrees" in out and "numpy disagrees" in out
    # tp's MLP output is a pending sum over tp; its all-reduce is where the residual is constrained.
    assert "first op where the runs part: op #" in out and "constrain ('batch', 'seq', 'embed') in blocks.1.mlp" in out
    assert "first collective that disagrees with its plan: all-reduce(tp)" in out
    report = json.loads(path.read_text())["backends"]
    assert report["jax-gspmd"]["agree"]
    for name in ("jax", "numpy"):
        bis = report[name]["bisect"]
        assert bis["first_op"]["layer"] == "blocks.1.mlp" and bis["first_op"]["op"].startswith("constrain")
        assert bis["first_collective"]["step"] == "all-reduce(tp)" and bis["first_collective"]["layer"] == "blocks.1.mlp"
        assert bis["first_collective"]["rel_err"] > 0.1


def test_bisect_of_agreeing_runs_finds_nothing():
    """The recorders themselves: every op of both explicit modes and GSPMD equals the reference."""
    from parlay.bisection import bisect
    from parlay.core import Mesh
    from parlay.core.models.gpt import GPT, PRESETS
    from parlay.core.program import make_program

    model = GPT(PRESETS["tiny-gqa"])
    program = make_program(model, "fsdp+tp_sp", Mesh(dp=2, tp=2), batch=8)
    x, y = np.random.default_rng(7).integers(0, 256, (2, 8, 16)).astype(np.int32)
    for backend in ("jax", "numpy", "jax-gspmd"):
        report = bisect(backend, program, {"tokens": x, "targets": y}, params=model.init(1))
        assert report.first_op is None and report.first_collective is None and report.structure is None
        assert report.ops > 60
    assert report.collectives_checked == 0  # GSPMD: XLA's collectives are not ours to tap


@pytest.mark.parametrize("argv, message", [
    (["compare", "--backends", "torch,mxnet"], "parlay: --backends 'torch,mxnet': mxnet is not a backend"),
    (["compare", "--mesh", "dp=16", "--strategy", "dp"], "parlay: --mesh 'dp=16' has 16 ranks; compare runs every backend"),
    (["compare", "--model", "huge"], "parlay: model 'huge' is not a preset (tiny, tiny-gqa"),
    (["compare", "--model", "nothere.py:m"], "parlay: model 'nothere.py:m': 'nothere.py' is not a file"),
    (["compare", "--strategy", "dp+nothere.py:s"], "parlay: strategy 'nothere.py:s': 'nothere.py' is not a file"),
    (["compare", "--drop-all-reduce", "blocks.9"], "parlay: --drop-all-reduce 'blocks.9' is not a layer of tiny; layers are"),
    (["compare", "--drop-all-reduce", "blocks.0.mlp", "--backends", "jax-gspmd"],
     "parlay: --drop-all-reduce plants its fault in the sharded executor (torch, jax, numpy)"),
    (["compare", "--backends", "jax,jax"], "parlay: --backends 'jax,jax' names a backend twice"),
    (["compare", "--mesh", "dp=2", "--strategy", "dp", "--steps", "1", "--backends", "numpy", "--plot", "",
      "--drop-all-reduce", "blocks.0.mlp"], "parlay: --drop-all-reduce blocks.0.mlp: no forward all-reduce ran in that layer"),
])
def test_bad_flags(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(message) and "\n" not in err, err


def test_a_strategy_that_cannot_run_prints_every_reason(capsys):
    assert main(["compare", "--mesh", "tp=3", "--strategy", "tp"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("parlay: strategy 'tp' cannot run this model on Mesh(tp=3) with batch 8:\n  - ")
    assert err.count("\n  - ") == 4  # vocab, heads, kv_heads, mlp


STRATEGY_MESHES = [
    ("dp", {"dp": 4}), ("zero1", {"dp": 4}), ("zero2", {"dp": 4}), ("fsdp", {"dp": 4}), ("tp", {"tp": 4}),
    ("tp_sp", {"tp": 4}), ("ulysses", {"sp": 4}), ("tp2d", {"row": 2, "col": 2}), ("fsdp+tp", {"dp": 2, "tp": 2}),
    ("dp+tp_sp", {"dp": 2, "tp": 2}), ("dp+tp+ulysses", {"dp": 2, "tp": 2, "sp": 2}),
]


@pytest.mark.exhaustive
@pytest.mark.parametrize("strategy, axes", STRATEGY_MESHES, ids=[s for s, _ in STRATEGY_MESHES])
def test_compare_agrees_for_every_strategy_on_every_backend(strategy, axes):
    from parlay.compare import run_compare
    from parlay.core import Mesh
    from parlay.core.models.gpt import GPT, PRESETS
    from parlay.core.program import make_program

    program = make_program(GPT(PRESETS["tiny-gqa"]), strategy, Mesh(axes), batch=8)
    ref, runs = run_compare(program, steps=2, bisect=False)
    assert [r.name for r in runs] == ["torch", "jax", "jax-gspmd", "numpy"]
    for r in runs:
        assert r.agree, (r.name, r.loss_diff, r.grad_diff, r.param_diff)


def test_bisect_flags_nan_and_inexact_data_moves():
    """A NaN output parts from the reference (NaN compares false with any tolerance); a gather
    must move data exactly, while a sum may differ by rounding relative to its addends."""
    from parlay.core.trace import Probe, check_step, compare_probes
    from parlay.core import Layout, Mesh, P, plan_redistribute, scatter

    ref = [Probe(0, "embed", "embed", value=np.ones(4)), Probe(1, "add", "blocks.0", value=np.ones(4))]
    got = [Probe(0, "embed", "embed", value=np.ones(4)), Probe(1, "add", "blocks.0", value=np.array([1, np.nan, 1, 1]))]
    report = compare_probes("jax", ref, got)
    assert report.first_op is got[1]
    mesh = Mesh(tp=2)
    x = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    gather_plan = plan_redistribute(Layout(mesh, P("tp")), Layout(mesh, P()), x.shape, itemsize=4)
    before = scatter(x, Layout(mesh, P("tp")))
    assert check_step(gather_plan, 0, before, [x, x]).ok
    nudged = x.copy()
    nudged[0, 0] = np.nextafter(nudged[0, 0], np.float32(9))
    assert not check_step(gather_plan, 0, before, [x, nudged]).ok
    sum_plan = plan_redistribute(Layout(mesh, P(), partial=("tp",)), Layout(mesh, P()), x.shape, itemsize=4)
    addends = [x, -x + np.float32(1e-3)]  # a sum that nearly cancels
    total = addends[0] + addends[1]
    assert check_step(sum_plan, 0, addends, [total * np.float32(1 + 1e-6)] * 2).ok
    assert not check_step(sum_plan, 0, addends, [total * 0] * 2).ok
