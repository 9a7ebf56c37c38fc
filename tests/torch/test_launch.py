"""torchrun launches the same program (gloo on this CPU machine; NCCL where CUDA is)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from parlay import Mesh
from parlay.backends.torch.launch import init_from_env
from parlay.core.models.gpt import GPT, PRESETS
from parlay.core.program import make_program
from parlay.core.session import get_backend


def test_torchrun_two_ranks_equal_one_process():
    worker = Path(__file__).with_name("torchrun_worker.py")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                          str(worker)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    model = GPT(PRESETS["tiny-gqa"])
    tokens = np.random.default_rng(0).integers(0, 256, (8, 17)).astype(np.int32)
    batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
    loss = get_backend("torch-single").run(make_program(model, "dp", Mesh(dp=1), batch=8), lambda s: s.eval_loss(batch))
    assert result["world"] == 2 and result["device"] == "cpu"
    assert abs(result["loss"] - loss) <= 1e-5 * loss


def test_init_from_env_without_torchrun(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(RuntimeError, match=r"not set; start the program with torchrun, e\.g\. torchrun --nproc_per_node"):
        init_from_env()
