"""Two processes of two CPU devices each (gloo) give the losses of one process of four devices."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from parlay import Mesh
from parlay.backends.jax.session import JaxSession
from parlay.core.models.gpt import GPT, PRESETS
from parlay.core.program import make_program

WORKER = Path(__file__).with_name("multiprocess_worker.py")
STRATEGY = "dp+tp"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_equal_one():
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(PARLAY_COORDINATOR=f"127.0.0.1:{port}", PARLAY_NUM_PROCESSES="2", JAX_PLATFORMS="cpu")
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), STRATEGY], env={**env, "PARLAY_PROCESS_ID": str(i)},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=300))
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    result = json.loads(outs[0][0].strip().splitlines()[-1])
    assert (result["devices"], result["local"]) == (4, 2)

    model = GPT(PRESETS["tiny-gqa"])
    program = make_program(model, STRATEGY, Mesh(dp=2, tp=2), batch=8)
    tokens = np.random.default_rng(0).integers(0, model.config.vocab, (8, model.config.seq + 1)).astype(np.int32)
    batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
    for mode in ("gspmd", "explicit"):
        session = JaxSession(program, mode, model.init(0))
        losses = [session.step(batch) for _ in range(3)]
        # Same program, same devices count, same reduction groups: equal to fp32 rounding.
        np.testing.assert_allclose(result[mode], losses, rtol=1e-6, err_msg=mode)
