"""Run by test_launch.py under torchrun: one dp=2 loss, printed by rank 0 as JSON."""

import json
import os

import numpy as np
import torch.distributed as dist

from parlay import Mesh
from parlay.backends.torch.launch import init_from_env
from parlay.backends.torch.session import TorchSession
from parlay.core.models.gpt import GPT, PRESETS
from parlay.core.program import make_program

device = init_from_env(timeout_s=60)
model = GPT(PRESETS["tiny-gqa"])
tokens = np.random.default_rng(0).integers(0, 256, (8, 17)).astype(np.int32)
session = TorchSession(make_program(model, "dp", Mesh(dp=dist.get_world_size()), batch=8), model.init(0))
loss = session.eval_loss({"tokens": tokens[:, :-1], "targets": tokens[:, 1:]})
if dist.get_rank() == 0:
    print(json.dumps({"device": device, "world": dist.get_world_size(), "loss": loss}), flush=True)
dist.barrier()  # let every rank finish before gloo tears down
dist.destroy_process_group()
# Seen once in ~30 runs: gloo aborts during interpreter shutdown ("terminate called without an
# active exception", a joinable thread destroyed at exit), after all work is done. Leave without
# running those destructors so the run's exit status reflects the work.
os._exit(0)
