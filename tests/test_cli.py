import os
import subprocess
import sys
from pathlib import Path

import pytest

from parlay.cli import main

EXAMPLE = ["redistribute", "--mesh", "dp=2,tp=4", "--shape", "8,16", "--src", "dp,tp", "--dst", "None,dp"]


def test_redistribute_prints_plan_and_pictures(capsys):
    assert main(EXAMPLE) == 0
    out = capsys.readouterr().out
    assert "Mesh(dp=2, tp=4), global shape (8, 16)" in out
    assert "src [dp, tp]  (local (4, 4))  ->  dst [None, dp]  (local (8, 8))" in out
    assert "total: 256 bytes sent by the busiest device" in out
    assert "all-gather(tp.0) dim 0" in out and "permute(" in out
    # before: 2 x 4 blocks, one rank each; after: 1 x 2 blocks of four ranks each
    assert "│ 0 │ 1 │ 2 │ 3 │" in out and "│ 4 │ 5 │ 6 │ 7 │" in out
    assert "│ 0,1,2,3 │ 4,5,6,7 │" in out


def test_partial_source_and_dtype(capsys):
    argv = ["redistribute", "--mesh", "tp=4", "--shape", "8", "--src", "None", "--src-partial", "tp",
            "--dst", "tp", "--dtype", "bf16"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "reduce-scatter(tp) dim 0" in out and "total: 12 bytes" in out  # 3/4 * 8 * 2 bytes
    assert "Σ 0,1,2,3" in out and "pending sum" in out


@pytest.mark.parametrize("argv, message", [
    (["redistribute", "--mesh", "dp2", "--shape", "8", "--src", "dp", "--dst", "None"],
     "parlay: --mesh 'dp2': 'dp2' is not NAME=SIZE; write e.g. --mesh dp=2,tp=4"),
    (["redistribute", "--mesh", "dp=2", "--shape", "8x", "--src", "dp", "--dst", "None"],
     "parlay: --shape '8x' is not a list of sizes; write e.g. --shape 8,16"),
    (["redistribute", "--mesh", "dp=2", "--shape", "8", "--src", "xx", "--dst", "None"],
     "parlay: spec P('xx') names axis 'xx', which Mesh(dp=2) lacks"),
    (["redistribute", "--mesh", "dp=2", "--shape", "7", "--src", "dp", "--dst", "None"],
     "parlay: dim 0 of shape (7,) has size 7, not divisible by 2 (dp=2)"),
    (["redistribute", "--mesh", "dp=2", "--shape", "8", "--src", "None", "--dst", "None", "--dst-partial", "dp"],
     "parlay: cannot redistribute [] to [] partial(dp): dst is partial over ['dp'] but src is not"),
    (["redistribute", "--mesh", "dp=2", "--shape", "8", "--src", "dp", "--dst", "None", "--dtype", "float7"],
     "parlay: --dtype 'float7' is unknown"),
    (["redistribute", "--mesh", "dp=2"], "parlay redistribute: the following arguments are required: --shape"),
    (["frobnicate"], "parlay: argument command: invalid choice: 'frobnicate'"),
    ([], "parlay: the following arguments are required: command"),
])
def test_bad_arguments_give_one_line_and_exit_2(argv, message, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith(message), err
    assert "\n" not in err and "Traceback" not in err and captured.out == ""


def test_console_script_and_module_entry_points():
    env = {**os.environ, "COLUMNS": "100"}
    script = Path(sys.executable).with_name("parlay")
    for cmd in ([str(script)], [sys.executable, "-m", "parlay"]):
        ok = subprocess.run(cmd + EXAMPLE, capture_output=True, text=True, env=env)
        assert ok.returncode == 0 and "total: 256 bytes" in ok.stdout, ok.stderr
        bad = subprocess.run(cmd + ["redistribute", "--mesh", "dp=3", "--shape", "8", "--src", "dp", "--dst", "None"],
                             capture_output=True, text=True, env=env)
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "not divisible by 3" in bad.stderr


def test_step_spawns_torch_ranks_and_runs_jax(capsys):
    assert main(["step", "--backend", "torch", "--mesh", "dp=2", "--strategy", "dp", "--steps", "2"]) == 0
    torch_out = capsys.readouterr().out
    assert "torch (2 gloo ranks)" in torch_out and "│    2 │" in torch_out
    assert main(["step", "--backend", "jax", "--mesh", "dp=2", "--strategy", "dp", "--steps", "2"]) == 0
    jax_out = capsys.readouterr().out
    assert main(["step", "--backend", "numpy", "--mesh", "dp=2", "--strategy", "dp", "--steps", "2"]) == 0
    numpy_out = capsys.readouterr().out
    # Same weights and inputs: the first step's loss agrees across backends.
    first = lambda text: float(text.split("│    1 │")[1].split("│")[0])
    assert abs(first(torch_out) - first(jax_out)) < 1e-5 and abs(first(numpy_out) - first(jax_out)) < 1e-5


def test_step_says_every_reason_a_strategy_cannot_run(capsys):
    assert main(["step", "--mesh", "dp=2", "--strategy", "tp"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("parlay: strategy 'tp' cannot run this model on Mesh(dp=2) with batch 8:\n  - strategy 'tp' "
                          "uses mesh axes ['tp'] but Mesh(dp=2) lacks ['tp']; e.g. --mesh tp=2")


@pytest.mark.parametrize("argv, message", [
    (["step", "--mesh", "dp=2", "--strategy", "dp", "--model", "nope"], "parlay: model 'nope' is not a preset (tiny,"),
    (["step", "--mesh", "dp=2", "--strategy", "zero4"], "parlay: unknown strategy 'zero4'"),
    (["step", "--mesh", "dp=4096", "--strategy", "dp"], "parlay: Mesh(dp=4096) has 4096 ranks; this machine runs at most"),
    (["step", "--mesh", "dp=2", "--strategy", "dp", "--ranks", "3"], "parlay: --ranks 3: Mesh(dp=2) has 2 ranks; the torch"),
    (["step", "--backend", "jax", "--mesh", "dp=2", "--strategy", "dp", "--ranks", "2"],
     "parlay: --ranks is the number of torch processes; jax runs in this process"),
    (["step", "--backend", "numpy", "--mesh", "dp=2", "--strategy", "dp", "--mode", "gspmd"],
     "parlay: --mode gspmd chooses JAX's execution mode; it does nothing with --backend numpy"),
    (["step", "--backend", "jax", "--mode", "gspmd", "--mesh", "dp=2", "--strategy", "dp", "--ranks", "2"],
     "parlay: --ranks is the number of torch processes; jax-gspmd runs in this process"),
    (["step", "--mesh", "dp=2", "--strategy", "dp", "--mode", "explicit"],  # torch: the default backend
     "parlay: --mode explicit chooses JAX's execution mode; it does nothing with --backend torch"),
    (["step", "--backend", "torch", "--mesh", "dp=2", "--strategy", "dp", "--mode", "gspmd"],
     "parlay: --mode gspmd chooses JAX's execution mode; it does nothing with --backend torch"),
])
def test_step_bad_arguments(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(message) and "\n" not in err, err
