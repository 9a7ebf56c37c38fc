"""``parlay train``: the GPT on real text, on either backend, with any strategy.

The data are bytes (the Python standard library's source by default, or named files) with a
held-out tail. Step ``t`` trains on ``corpus.batch_at(t)``, a function of (seed, t) alone, and the
evaluation set is a fixed list of held-out batches, so two runs (or a resumed one) read the same
data on any backend. The loop runs in this process on JAX and in every spawned gloo rank on
torch; rank 0 sends its events (one per step, one per evaluation) back to the parent, which
draws the progress bar.
"""

from __future__ import annotations

import math
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
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0  # save every K steps (and after the last); 0: never
    keep_last: int | None = 3  # committed checkpoints kept (None: all)


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    evals: list[tuple[int, float]] = field(default_factory=list)
    seconds: float = 0.0
    first_step_s: float = 0.0  # includes compilation / process start
    last_step_s: float = 0.0
    steps_run: int = 0  # by this process (a resumed run: after the checkpoint)

    def tokens_per_s(self, spec: TrainSpec, seq: int) -> float:
        """Between the first step's end and the last's (evaluations included)."""
        steady = self.last_step_s - self.first_step_s
        n = self.steps_run - 1
        return n * spec.batch * seq / steady if n > 0 and steady > 0 else 0.0


def _corpus(spec: TrainSpec):
    from .data import load_corpus

    return load_corpus(list(spec.data) or None, max_bytes=spec.max_bytes)


def config_json(config) -> dict:
    import enum
    from dataclasses import fields

    return {f.name: (v.value if isinstance(v, enum.Enum) else v) for f in fields(config)
            for v in [getattr(config, f.name)]}


def config_from_json(data: dict, where: str = "model config"):
    """A ``GPTConfig`` from ``config_json``'s dict (enums by value), every field checked."""
    import enum
    from dataclasses import fields

    from .core.model import GPTConfig

    if not isinstance(data, dict):
        raise ValueError(f"{where} must be an object, not {data!r:.80}")
    known = {f.name: f for f in fields(GPTConfig)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r}; GPTConfig has {sorted(known)}")
    values = {}
    for name, value in data.items():
        default = getattr(GPTConfig(), name)
        if isinstance(default, enum.Enum):
            try:
                value = type(default)(value)
            except ValueError:
                raise ValueError(f"{where}: field {name!r} is {value!r}; one of "
                                 f"{[e.value for e in type(default)]}") from None
        values[name] = value
    return GPTConfig(**values)


def _meta(spec: TrainSpec, count: int, history: dict) -> dict:
    """The run's state besides the tensors: what a resume on any backend needs."""
    from .core.model import PRESETS

    return {"count": count, "backend": spec.backend, "mode": spec.mode, "preset": spec.preset,
            "model": config_json(PRESETS[spec.preset]), "mesh": dict(spec.mesh), "strategy": spec.strategy,
            "optimizer": asdict(spec.optimizer),
            "data": {"seed": spec.seed, "batch": spec.batch, "files": list(spec.data), "max_bytes": spec.max_bytes},
            "rng": {"seed": spec.seed, "streams": "training batch t: numpy default_rng([seed, t, 1]); held-out batch "
                                                  "i: default_rng([seed, i, 0]); the model has no other randomness"},
            "losses": history["losses"], "evals": history["evals"]}


class TrainingDiverged(RuntimeError):
    """The loss stopped being a finite number."""


def _differences(saved: dict, want: dict) -> str:
    """"key saved vs wanted" for each key whose values differ."""
    return ", ".join(f"{k} {saved.get(k)!r} vs {want.get(k)!r}" for k in sorted(set(saved) | set(want))
                     if saved.get(k) != want.get(k))


def _check_model(ckpt, spec: TrainSpec) -> None:
    from .checkpoint import CheckpointError
    from .core.model import PRESETS

    saved, want = ckpt.meta("model"), config_json(PRESETS[spec.preset])
    if saved != want:
        raise CheckpointError(f"{ckpt.path}/manifest.json: field 'model' differs from --model {spec.preset}: "
                              f"{_differences(saved, want)}")


def check_init(ckpt, spec: TrainSpec) -> None:
    """A checkpoint's parameters start this run only if its model is --model's."""
    _check_model(ckpt, spec)
    ckpt.open_all()


def check_resume(ckpt, spec: TrainSpec) -> None:
    """A checkpoint continues this run only with the same model, data and optimizer."""
    from .checkpoint import CheckpointError

    where = f"{ckpt.path}/manifest.json"
    _check_model(ckpt, spec)
    data = ckpt.meta("data")
    want = {"seed": spec.seed, "batch": spec.batch, "files": list(spec.data), "max_bytes": spec.max_bytes}
    if data != want:
        raise CheckpointError(f"{where}: field 'data' is {data}; this run reads {want} (resume with the same "
                              f"--seed, --batch and --data)")
    saved, want = ckpt.meta("optimizer"), asdict(spec.optimizer)
    if saved != want:
        diff = _differences(saved, want)
        hint = (" (the cosine schedule ends at the run's --steps: resume with the same --steps; a run trained with "
                "--no-cosine can be extended)") if saved.get("decay_steps") != want.get("decay_steps") else ""
        raise CheckpointError(f"{where}: field 'optimizer' differs from this run's: {diff}{hint}")
    if ckpt.step >= spec.steps:
        raise CheckpointError(f"{where}: the checkpoint is already at step {ckpt.step} and --steps is {spec.steps}: "
                              f"nothing left to train")
    for key in ("losses", "evals"):
        if not isinstance(ckpt.meta(key), list):
            raise CheckpointError(f"{where}: field {key!r} must be a list")
    ckpt.open_all()  # every tensor file's header, before any process starts


def _crash_hook(step: int):
    """Fault injection for tests: PARLAY_CHECKPOINT_CRASH=STAGE@STEP kills this process with
    SIGKILL at STAGE ("before-manifest" or "before-rename") of the save of step STEP."""
    import os
    import signal

    stage, _, at = os.environ.get("PARLAY_CHECKPOINT_CRASH", "").partition("@")
    if not stage or at != str(step):
        return None
    return lambda where: os.kill(os.getpid(), signal.SIGKILL) if where == stage else None


def _loop(session, spec: TrainSpec, corpus, emit: Callable, *, start: int = 0, history: dict | None = None,
          rank: int = 0, barrier=lambda: None) -> None:
    """``session.step(x, y) -> loss``, ``session.eval_loss(x, y) -> loss`` and
    ``session.checkpoint_tensors()`` from step ``start``; saves every ``checkpoint_every`` steps."""
    from . import checkpoint
    from .core.model import PRESETS

    seq = PRESETS[spec.preset].seq
    history = history or {"losses": [], "evals": []}
    evalset = [corpus.batch_at(i, spec.batch, seq, seed=spec.seed, split="held_out") for i in range(spec.eval_batches)]
    for t in range(start, spec.steps):
        loss = session.step(*corpus.batch_at(t, spec.batch, seq, seed=spec.seed))
        if not math.isfinite(loss):
            raise TrainingDiverged(f"step {t + 1}: the loss is {loss}; training diverged (lower --lr, or check the "
                                   f"data and the checkpoint it started from)")
        history["losses"].append(loss)
        emit(("step", t + 1, loss))
        if spec.eval_batches and ((t + 1) % spec.eval_every == 0 or t + 1 == spec.steps):
            ev = float(np.mean([session.eval_loss(x, y) for x, y in evalset]))
            history["evals"].append([t + 1, ev])
            emit(("eval", t + 1, ev))
        if spec.checkpoint_dir and spec.checkpoint_every and ((t + 1) % spec.checkpoint_every == 0 or t + 1 == spec.steps):
            tensors, blocks, count = session.checkpoint_tensors()
            if not all(np.isfinite(a).all() for data in blocks.values() for a in data.values()):
                raise TrainingDiverged(f"step {t + 1}: the parameters or optimizer states are no longer finite; "
                                       f"no checkpoint saved (lower --lr)")
            checkpoint.save(spec.checkpoint_dir, t + 1, tensors, blocks, _meta(spec, count, history), lead=rank == 0,
                            barrier=barrier, keep_last=spec.keep_last, crash_hook=_crash_hook(t + 1))
            emit(("checkpoint", t + 1, str(checkpoint.step_dir(spec.checkpoint_dir, t + 1))))


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

    def checkpoint_tensors(self):
        return self.ts.checkpoint_tensors(self.state)

    def restore(self, ckpt, params_only: bool = False) -> None:
        self.state = self.ts.restore(ckpt, params_only=params_only)


def _history(ckpt) -> dict:
    return {"losses": list(ckpt.meta("losses")), "evals": [list(e) for e in ckpt.meta("evals")]} if ckpt else None


def _torch_worker(rank, spec: TrainSpec, events, resume: str | None, init_from: str | None = None):
    import torch.distributed as dist

    from .backends.torch.train import ShardedModel, ShardedTrainer
    from .checkpoint import Checkpoint
    from .core import Mesh
    from .core.model import GPT, PRESETS

    model = GPT(PRESETS[spec.preset])
    trainer = ShardedTrainer(ShardedModel(model, spec.strategy, Mesh(spec.mesh), batch=spec.batch),
                             model.init(spec.seed), optimizer=spec.optimizer)
    ckpt = Checkpoint(resume) if resume else None
    if ckpt:
        trainer.restore(ckpt)
    elif init_from:
        trainer.restore(Checkpoint(init_from), params_only=True)
    _loop(trainer, spec, _corpus(spec), events.put if rank == 0 else (lambda e: None),
          start=ckpt.step if ckpt else 0, history=_history(ckpt), rank=rank, barrier=dist.barrier)
    if rank == 0:  # flush the events into the pipe before spawn may stop this process
        events.close()
        events.join_thread()
    return None


def run_train(spec: TrainSpec, on_event: Callable[[tuple], None] = lambda e: None, *,
              resume=None, init_from=None, corpus=None) -> TrainResult:
    """Train, continuing the checkpoint ``resume`` or starting from the parameters of
    ``init_from`` (folders or ``Checkpoint``s), on ``corpus`` (default: the spec's);
    ``on_event(("step", t, loss))`` after each step, ``("eval", t, loss)`` after each
    evaluation, ``("checkpoint", t, path)`` after each save (in this process, whichever backend
    runs)."""
    from .checkpoint import Checkpoint

    as_checkpoint = lambda c: c if c is None or isinstance(c, Checkpoint) else Checkpoint(c)
    ckpt, init = as_checkpoint(resume), as_checkpoint(init_from)
    result = TrainResult()
    start = time.perf_counter()
    if init:
        check_init(init, spec)
    if ckpt:
        check_resume(ckpt, spec)
        history = _history(ckpt)
        result.losses, result.evals = list(history["losses"]), [tuple(e) for e in history["evals"]]
    first = (ckpt.step if ckpt else 0) + 1

    def record(event):
        kind, t, value = event
        if kind == "step":
            result.losses.append(value)
            result.steps_run += 1
            result.last_step_s = time.perf_counter() - start
            if t == first:
                result.first_step_s = time.perf_counter() - start
        elif kind == "eval":
            result.evals.append((t, value))
        on_event(event)

    if spec.backend == "jax":
        use_host_devices(int(np.prod([n for _, n in spec.mesh])))
        session = _JaxSession(spec)
        if ckpt:
            session.restore(ckpt)
        elif init:
            session.restore(init, params_only=True)
        _loop(session, spec, corpus or _corpus(spec), record, start=ckpt.step if ckpt else 0, history=_history(ckpt))
    elif spec.backend == "torch":
        import multiprocessing as mp

        from .backends.torch.launch import spawn

        events = mp.get_context("spawn").Queue()
        failure: list = []

        def launch():
            try:
                spawn(_torch_worker, int(np.prod([n for _, n in spec.mesh])), spec, events,
                      *(None if c is None else str(c.path) for c in (ckpt, init)),
                      timeout_s=600, wall_s=None)  # a collective may take 10 minutes; the run, any time
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
                if not thread.is_alive():  # the sentinel may never come if a rank died mid-put
                    break
                continue
            if event is None:
                break
            record(event)
        thread.join()
        events.cancel_join_thread()
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
