"""``parlay schedule``: the table, the figures, the JSON and the PNG timeline; bad input in one line."""

import json

import pytest

from parlay.cli import main


def test_schedule_prints_table_figures_and_writes_json_and_png(tmp_path, capsys):
    out_json, out_png = tmp_path / "s.json", tmp_path / "s.png"
    argv = ["schedule", "--pp", "4", "--microbatches", "8", "--schedule", "1f1b", "--activation-bytes", "1024",
            "--json", str(out_json), "--plot", str(out_png)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "rank 3: 3F0 3B0 3F1 3B1" in out
    assert "makespan 33; bubble 0.2727 of the makespan (0.3750 of the ideal time)" in out  # 3/11; 9/24
    data = json.loads(out_json.read_text())
    assert data["peak_in_flight"] == [4, 3, 2, 1] and data["bytes_sent"] == [8192, 16384, 16384, 8192]
    assert data["actions"][3][:2] == ["3F0", "3B0"] and data["with_comms"][3][0] == "3RECV_F0"
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out_png.stat().st_size > 5000


def test_schedule_zero_bubble_and_comms(capsys):
    assert main(["schedule", "--pp", "2", "--microbatches", "4", "--schedule", "zbv", "--comms", "--plot", ""]) == 0
    out = capsys.readouterr().out
    assert "zbv schedule: p=2 ranks, m=4 microbatches, 4 stages (2 a rank, v placement)" in out
    assert "3SEND_B0" in out and "makespan 25" in out


@pytest.mark.parametrize("argv, message", [
    (["--pp", "4", "--microbatches", "6", "--schedule", "interleaved"],
     "parlay: interleaved 1F1B takes microbatches in groups of p (Megatron's order): microbatches=6 is not a multiple "
     "of p=4. Use 4 or 8."),
    (["--pp", "2", "--microbatches", "2", "--schedule", "dualpipe"], "parlay: schedule 'dualpipe' is unknown"),
    (["--pp", "0", "--microbatches", "2"], "parlay: --pp 0 and --microbatches 2 must be positive"),
    (["--pp", "2", "--microbatches", "2", "--costs", "1,0,1"], "parlay: --costs '1,0,1': give three positive numbers"),
    (["--pp", "2", "--microbatches", "2", "--plot", "x.gif"], "parlay: --plot 'x.gif': the file name must end in one of"),
])
def test_schedule_bad_input_one_line(argv, message, capsys):
    assert main(["schedule", *argv, "--plot", argv[argv.index("--plot") + 1]] if "--plot" in argv
                else ["schedule", *argv, "--plot", ""]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(message), err
    assert "\n" not in err


def test_compare_and_step_run_a_pipeline(capsys):
    argv = ["--strategy", "pp+dp", "--mesh", "pp=2,dp=2", "--microbatches", "2", "--schedule", "zb-h1"]
    assert main(["compare", *argv, "--steps", "2", "--backends", "numpy", "--plot", ""]) == 0
    out = capsys.readouterr().out
    flat = " ".join(out.split())  # the table wraps at the terminal's width
    assert "tiny, pp+dp (zb-h1, 2 microbatches) on Mesh(pp=2, dp=2)" in flat and "agree │ yes" in flat
    assert main(["step", "--backend", "numpy", "--strategy", "dp", "--mesh", "dp=2", "--schedule", "1f1b"]) == 2
    assert "schedule '1f1b' needs a pipeline" in capsys.readouterr().err
