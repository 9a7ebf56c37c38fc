"""parlay's GPT trained in an ordinary Flax NNX loop crosses to torch and back through parlay
checkpoints: the NNX loop's checkpoint resumes under ``parlay train --backend torch --resume`` with
the uninterrupted losses, and torch's checkpoint continues in the NNX loop."""

import json

import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")

from parlay.flax_nnx import GPT, adamw, load_checkpoint  # noqa: E402
from parlay.cli import main  # noqa: E402
from parlay.core.optim import OptimizerConfig  # noqa: E402
from parlay.training import TrainSpec  # noqa: E402

from examples.nnx_gpt import train as train_nnx  # noqa: E402  (the README's ordinary NNX loop)

# 8 steps, the learning rate warming up over 3 and decaying to the 8th, as parlay train sets it.
FLAGS = ["--model", "tiny", "--steps", "8", "--batch", "8", "--warmup", "3", "--lr", "1e-2", "--eval-every", "4",
         "--eval-batches", "2", "--backend", "torch", "--mesh", "dp=2,tp=2", "--strategy", "dp+tp"]
OPTIMIZER = OptimizerConfig(lr=1e-2, warmup=3, decay_steps=8)


@pytest.mark.slow
def test_an_nnx_trained_gpt_resumes_on_torch_and_back(tmp_path):
    def train(name, *flags):
        assert main(["train", *FLAGS, *flags, "--json", str(tmp_path / f"{name}.json")]) == 0
        return json.loads((tmp_path / f"{name}.json").read_text())["losses"]

    full = train("full", "--checkpoint-dir", str(tmp_path / "torch"), "--checkpoint-every", "4")

    # The NNX loop under fsdp+tp on 8 JAX devices: the spec says what parlay train --resume will check.
    spec = TrainSpec(backend="torch", strategy="dp+tp", mesh=(("dp", 2), ("tp", 2)), model="tiny", steps=8,
                     batch=8, optimizer=OPTIMIZER, checkpoint_dir=str(tmp_path / "nnx"))
    module = GPT("tiny", strategy="fsdp+tp", mesh=dict(dp=2, tp=4), batch=8)
    ours = train_nnx(module, nnx.Optimizer(module, adamw(OPTIMIZER), wrt=nnx.Param), spec, range(8), save_at=4)
    np.testing.assert_allclose(ours, full, rtol=1e-6)  # measured 1.1e-7

    resumed = train("resumed", "--checkpoint-dir", str(tmp_path / "nnx"), "--resume")
    assert resumed[:4] == ours[:4]  # the NNX loop's history travels in the manifest
    np.testing.assert_allclose(resumed[4:], full[4:], rtol=1e-6)  # measured 7.3e-8
    np.testing.assert_allclose(resumed[4:], ours[4:], rtol=1e-6)

    # Back: torch's step-4 checkpoint continues in a fresh NNX module under dp on 4 devices.
    back = GPT("tiny", seed=9, strategy="dp", mesh=dict(dp=4), batch=8)
    opt = nnx.Optimizer(back, adamw(OPTIMIZER), wrt=nnx.Param)
    assert load_checkpoint(back, tmp_path / "torch" / "step-00000004", opt) == 4
    np.testing.assert_allclose(train_nnx(back, opt, spec, range(4, 8)), full[4:], rtol=1e-6)  # measured 6.8e-8
