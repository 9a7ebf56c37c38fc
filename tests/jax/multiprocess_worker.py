"""One process of a multi-process JAX run (started by test_multiprocess.py).

PARLAY_COORDINATOR, PARLAY_NUM_PROCESSES and PARLAY_PROCESS_ID come from the environment.
Prints the losses of three AdamW steps per mode as JSON on process 0.
"""

import json
import sys

from parlay.backends.jax import distributed

distributed.initialize(local_devices=2)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from parlay import Mesh  # noqa: E402
from parlay.backends.jax.session import JaxSession  # noqa: E402
from parlay.core.models.gpt import GPT, PRESETS  # noqa: E402
from parlay.core.program import make_program  # noqa: E402

model = GPT(PRESETS["tiny-gqa"])
program = make_program(model, sys.argv[1], Mesh(dp=2, tp=2), batch=8)
tokens = np.random.default_rng(0).integers(0, model.config.vocab, (8, model.config.seq + 1)).astype(np.int32)
batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
out = {"devices": jax.device_count(), "local": jax.local_device_count()}
for mode in ("gspmd", "explicit"):
    session = JaxSession(program, mode, model.init(0))
    out[mode] = [session.step(batch) for _ in range(3)]
if jax.process_index() == 0:
    print(json.dumps(out))
