"""The model in examples/ (a ViT-style encoder on scikit-learn's digits, not a GPT): it compares,
trains and resumes across backends from the command line, with its own strategies."""

import json
import shutil
from pathlib import Path

import numpy as np

from parlay.checkpoint import committed
from parlay.cli import main

VIT = str(Path(__file__).parents[1] / "examples" / "vit.py")
MODEL = ["--model", f"{VIT}:model"]


def test_the_example_agrees_on_every_backend(tmp_path):
    """(torch: the resume below, and the ViT's random rule sets in tests/test_differential.py.)"""
    report = tmp_path / "r.json"
    argv = ["compare", *MODEL, "--strategy", f"{VIT}:FSDP+{VIT}:TP", "--mesh", "dp=2,tp=2", "--steps", "2",
            "--backends", "jax,jax-gspmd,numpy", "--plot", "", "--json", str(report)]
    assert main(argv) == 0
    runs = json.loads(report.read_text())["backends"]
    assert set(runs) == {"jax", "jax-gspmd", "numpy"} and all(r["agree"] for r in runs.values())


def _train(tmp_path, name, *flags):
    path = tmp_path / f"{name}.json"
    common = [*MODEL, "--steps", "120", "--batch", "32", "--warmup", "10", "--lr", "1e-2", "--eval-every", "60",
              "--eval-batches", "4"]
    assert main(["train", *common, *flags, "--json", str(path)]) == 0
    return json.loads(path.read_text())


def test_the_example_trains_and_resumes_on_another_backend_strategy_and_mesh(tmp_path, capsys):
    d = tmp_path / "ckpt"
    full = _train(tmp_path, "full", "--backend", "jax", "--strategy", f"{VIT}:DATA", "--mesh", "dp=4",
                  "--checkpoint-dir", str(d), "--checkpoint-every", "60")
    # It learns: measured 1.48 nats after 120 steps against 2.30 for a uniform guess over 10 digits.
    assert full["baseline"]["value"] == np.log(10) and full["eval"][-1]["loss"] < 1.8, full["eval"]
    manifest = json.loads((d / "step-00000060" / "manifest.json").read_text())
    assert manifest["model"]["ref"] == f"{VIT}:model" and manifest["model"]["describe"]["kind"] == "vit"
    shutil.rmtree(d / "step-00000120")
    assert [p.name for p in committed(d)] == ["step-00000060"]
    resumed = _train(tmp_path, "resumed", "--backend", "torch", "--strategy", f"{VIT}:DATA+{VIT}:TP",
                     "--mesh", "dp=2,tp=2", "--checkpoint-dir", str(d), "--resume")
    np.testing.assert_allclose(resumed["losses"], full["losses"], rtol=1e-5)
    np.testing.assert_allclose([e["loss"] for e in resumed["eval"]], [e["loss"] for e in full["eval"]], rtol=1e-5)
    # The checkpoint says how to rebuild its model: resuming it as another model is refused, naming it.
    assert main(["train", "--backend", "jax", "--mesh", "dp=2", "--strategy", "dp", "--steps", "120",
                 "--checkpoint-dir", str(d), "--resume"]) == 2
    assert f"the checkpoint holds {VIT}:model, not --model tiny; resume with --model {VIT}:model" in capsys.readouterr().err
