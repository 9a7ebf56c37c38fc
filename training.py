"""``parlay train``: the GPT on real text, on either backend, with any strategy.

The data are bytes (the Python standard library's source by default, or named files) with a
held-out tail. Step ``t`` trains on ``corpus.batch_at(t)``, a function of (seed, t) alone, and the
evaluation set is a fixed list of held-out batches, so two runs (or a resumed one) read the same
data on any backend. The loop runs in this process on JAX and in every spawned gloo rank on
torch; rank 0 sends its events (one per step, one per evaluation) back to the parent, which
draws the progress bar.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from .core.optim import OptimizerConfig
from .xla_env import use_host_devices

__all__ = ["TrainSpec", "TrainResult", "run_train"]


@dataclass(frozen=True)
class TrainSpec:
    backend: str  # "torch" or "jax"
    strategy: str
    mesh: tuple[tuple[str, int], ...]
    preset: str = "tiny"
    mode: str = "explicit"  # jax: "explicit" (shard_map) or "gspmd"
    steps: int = 300
    batch: int = 16
    seed: int = 0
    optimizer: OptimizerConfig = OptimizerConfig()
    eval_every: int = 50
    eval_batches: int = 8
    data: tuple[str, ...] = ()  # files; empty: the standard library
    max_bytes: int = 16 * 2**20


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    evals: list[tuple[int, float]] = field(default_factory=list)
    seconds: float = 0.0
    first_step_s: float = 0.0  # includes compilation / process start

    def tokens_per_s(self, spec: TrainSpec, seq: int) -> float:
        steady = self.seconds - self.first_step_s
        n = len(self.losses) - 1
        return n * spec.batch * seq / steady if n > 0 and steady > 0 else 0.0


def _corpus(spec: TrainSpec):
    from .data import load_corpus

    return load_corpus(list(spec.data) or None, max_bytes=spec.max_bytes)


def _loop(session, spec: TrainSpec, corpus, emit: Callable, start: int = 0) -> None:
    """``session.step(x, y) -> loss`` and ``session.eval_loss(x, y) -> loss`` from step ``start``."""
    from .core.model import PRESETS

    seq = PRESETS[spec.preset].seq
    evalset = [corpus.batch_at(i, spec.batch, seq, seed=spec.seed, split="held_out") for i in range(spec.eval_batches)]
    for t in range(start, spec.steps):
        loss = session.step(*corpus.batch_at(t, spec.batch, seq, seed=spec.seed))
        emit(("step", t + 1, loss))
        if spec.eval_batches and ((t + 1) % spec.eval_every == 0 or t + 1 == spec.steps):
            emit(("eval", t + 1, float(np.mean([session.eval_loss(x, y) for x, y in evalset]))))


class _JaxSession:
    def __init__(self, spec: TrainSpec):
        from .backends.jax.train import TrainStep
        from .core import Mesh
        from .core.model import GPT, PRESETS

        model = GPT(PRESETS[spec.preset])
        self.ts = TrainStep(model, strategy=spec.strategy, mesh=Mesh(spec.mesh), mode=spec.mode,
                            optimizer=spec.optimizer, batch=spec.batch)
        self.state = self.ts.init(model.init(spec.seed))

    def step(self, x, y) -> float:
        self.state, loss = self.ts(self.state, x, y)
        return float(loss)

    def eval_loss(self, x, y) -> float:
        return self.ts.eval_loss(self.state, x, y)


def _torch_worker(rank, spec: TrainSpec, events):
    from .backends.torch.train import ShardedModel, ShardedTrainer
    from .core import Mesh
    from .core.model import GPT, PRESETS

    model = GPT(PRESETS[spec.preset])
    trainer = ShardedTrainer(ShardedModel(model, spec.strategy, Mesh(spec.mesh), batch=spec.batch),
                             model.init(spec.seed), optimizer=spec.optimizer)
    _loop(trainer, spec, _corpus(spec), events.put if rank == 0 else (lambda e: None))
    if rank == 0:  # flush the events into the pipe before spawn may stop this process
        events.close()
        events.join_thread()
    return None


def run_train(spec: TrainSpec, on_event: Callable[[tuple], None] = lambda e: None) -> TrainResult:
    """Train; ``on_event(("step", t, loss))`` after each step, ``("eval", t, loss)`` after each
    evaluation (in this process, whichever backend runs)."""
    result = TrainResult()
    start = time.perf_counter()

    def record(event):
        kind, t, loss = event
        if kind == "step":
            result.losses.append(loss)
            if t == 1:
                result.first_step_s = time.perf_counter() - start
        else:
            result.evals.append((t, loss))
        on_event(event)

    if spec.backend == "jax":
        use_host_devices(int(np.prod([n for _, n in spec.mesh])))
        _loop(_JaxSession(spec), spec, _corpus(spec), record)
    elif spec.backend == "torch":
        import multiprocessing as mp

        from .backends.torch.launch import spawn

        events = mp.get_context("spawn").Queue()
        failure: list = []

        def launch():
            try:
                spawn(_torch_worker, int(np.prod([n for _, n in spec.mesh])), spec, events, timeout_s=3600)
            except BaseException as e:
                failure.append(e)
            finally:
                events.put(None)

        thread = threading.Thread(target=launch, daemon=True)
        thread.start()
        while True:
            try:
                event = events.get(timeout=1.0)
            except queue.Empty:
                continue
            if event is None:
                break
            record(event)
        thread.join()
        if failure:
            raise failure[0]
    else:
        raise ValueError(f"backend {spec.backend!r} is unknown; choose torch or jax.")
    result.seconds = time.perf_counter() - start
    return result


def spec_json(spec: TrainSpec) -> dict:
    out = asdict(spec)
    out["mesh"] = dict(spec.mesh)
    out["data"] = list(spec.data) or "the Python standard library"
    return out
