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
from parlay.backends.jax.train import TrainStep  # noqa: E402
from parlay.core.model import GPT, PRESETS  # noqa: E402

model = GPT(PRESETS["tiny-gqa"])
params = model.init(seed=0)
tokens = np.random.default_rng(0).integers(0, model.config.vocab, (8, model.config.seq + 1))
x, y = tokens[:, :-1], tokens[:, 1:]
out = {"devices": jax.device_count(), "local": jax.local_device_count()}
for mode in ("gspmd", "explicit"):
    step = TrainStep(model, strategy=sys.argv[1], mesh=Mesh(dp=2, tp=2), mode=mode)
    state, losses = step.init(params), []
    for _ in range(3):
        state, loss = step(state, x, y)
        losses.append(float(distributed.fetch(loss)))
    out[mode] = losses
if jax.process_index() == 0:
    print(json.dumps(out))
