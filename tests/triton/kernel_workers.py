"""Run on spawned gloo ranks by the kernel tests (module-level, so spawn can import them)."""

import contextlib
from collections import Counter
from typing import Iterator

import numpy as np

from parlay.core.models.gpt import GPT, PRESETS
from parlay.triton_kernels import _launch, use_kernels
from sharded_case import run_case


def gpt_inputs(preset: str, batch: int = 2, seed: int = 0):
    """The model, parameters with every norm scale and bias moved off 1 and 0, and a batch."""
    model = GPT(PRESETS[preset])
    rng = np.random.default_rng(seed)
    params = {k: (v + 0.1 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in model.init(seed).items()}
    tokens = rng.integers(0, model.config.vocab, (batch, model.config.seq + 1)).astype(np.int32)
    return model, params, {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}


@contextlib.contextmanager
def count_launches() -> Iterator[Counter]:
    """Count the kernel launches inside the block, by kernel name."""
    launches: Counter = Counter()
    launch = _launch._Kernel.__getitem__

    def counted(self, grid):
        launches[self.__name__] += 1
        return launch(self, grid)

    _launch._Kernel.__getitem__ = counted
    try:
        yield launches
    finally:
        _launch._Kernel.__getitem__ = launch


def single_loss_and_grads(model, params, batch, precision="fp32"):
    """The single-process torch reference (the kernel switch as the caller set it)."""
    from parlay import Mesh
    from parlay.backends.torch.session import TorchSingleSession
    from parlay.core.program import make_program

    program = make_program(model, "dp", Mesh(dp=1), batch=len(batch["tokens"]), precision=precision)
    return TorchSingleSession(program, params).loss_and_grads(batch)


def sharded_loss_and_grads(rank, preset, cases):
    """Per (strategy, mesh axes) and kernel choice: loss, global grads (rank 0), forward and backward
    collective counts, and the kernels launched."""
    model, params, batch = gpt_inputs(preset)
    out = {}
    for strategy, axes in cases:
        for kernels in ("torch", "triton"):
            with use_kernels(kernels), count_launches() as launches:
                result = run_case(rank, model, params, batch, strategy, axes)
            out[strategy, kernels] = (*result, dict(launches))
    return out
