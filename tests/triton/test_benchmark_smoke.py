"""benchmarks/triton_gpu.py end to end in its --smoke mode (tiny sizes, CPU, Triton's interpreter,
a plain timer): its checks pass and it prints a row per kernel and pass. Timings are not checked."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_gpu_benchmark_runs_in_smoke_mode():
    out = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "triton_gpu.py"), "--smoke", "--markdown"],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and "parlay ms" not in line]
    names = [r.split("|")[1].strip() + " " + r.split("|")[3].strip() for r in rows]
    assert names == ["rms_norm fwd", "rms_norm fwd+bwd", "layer_norm fwd", "layer_norm fwd+bwd",
                     "attention MHA fwd", "attention MHA fwd+bwd", "attention GQA fwd", "attention GQA fwd+bwd",
                     "cross_entropy fwd", "cross_entropy fwd+bwd", "adamw_step step"], out.stdout
    assert all("(ok <=" in r for r in rows), out.stdout
