"""parlay compare: agreement on every backend, a planted wrong collective caught, bad flags."""

import json

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
    assert set(report["backends"]) == {"torch", "jax", "jax-gspmd"}
    for run in report["backends"].values():
        assert len(run["losses"]) == 2 and run["agree"]
        assert run["param_rel_diff"] <= report["tolerance"]["param"]
    assert report["reference"]["losses"][1] < report["reference"]["losses"][0]


def test_a_dropped_all_reduce_makes_compare_exit_1(monkeypatch, capsys):
    """Plant a wrong collective in JAX explicit mode (every all-reduce step becomes a no-op)."""
    from parlay.backends.jax import collectives
    from parlay.core import AllReduce

    real = collectives.run_step
    monkeypatch.setattr(collectives, "run_step",
                        lambda step, x, *a: x if isinstance(step, AllReduce) else real(step, x, *a))
    argv = ["compare", "--model", "tiny", "--mesh", "tp=2", "--strategy", "tp", "--steps", "2", "--backends", "jax",
            "--plot", ""]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "NO" in out and "jax disagrees" in out


@pytest.mark.parametrize("argv, message", [
    (["compare", "--backends", "torch,mxnet"], "parlay: --backends 'torch,mxnet': mxnet is not a backend"),
    (["compare", "--mesh", "dp=16", "--strategy", "dp"], "parlay: --mesh 'dp=16' has 16 ranks; compare runs every backend"),
    (["compare", "--model", "huge"], "parlay: --model 'huge' is unknown"),
    (["compare", "--mesh", "dp=2", "--strategy", "tp"], "parlay: strategy 'tp' cannot run on Mesh(dp=2)"),
])
def test_bad_flags(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(message) and "\n" not in err, err
