"""``parlay train``: any model on its dataset, on any backend, with any strategy.

Step ``t`` trains on ``dataset.batch_at(t)``, a function of (seed, t) alone, and the evaluation
set is a fixed list of held-out batches, so two runs (or a resumed one) read the same data on
any backend. The loop (``train_loop``) runs wherever the backend runs the program: in this
process (JAX, numpy) or in every spawned rank (torch); the lead sends its events back through
``Session.emit`` and the caller draws the progress bar.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from .core.mesh import Mesh
from .core.model import Split, dataset_source, model_dataset
from .core.optim import OptimizerConfig
from .core.program import Program, program_from
from .core.session import get_backend

__all__ = ["TrainSpec", "TrainResult", "StepEvent", "EvalEvent", "CheckpointEvent", "TrainingDiverged", "run_train",
           "make_train_program", "model_meta", "check_resume", "check_init", "dataset_of", "save_checkpoint",
           "data_digests"]


@dataclass(frozen=True)
class TrainSpec:
    backend: str  # a registry name: torch, jax (explicit), jax-gspmd, numpy
    strategy: str
    mesh: tuple[tuple[str, int], ...]
    model: str = "tiny"  # a preset or FILE.py:NAME / module:NAME
    steps: int = 300
    batch: int = 16
    seed: int = 0
    optimizer: OptimizerConfig = OptimizerConfig()
    microbatches: int = 1  # gradient accumulation: each step's batch as this many microbatches
    schedule: str | None = None  # the pipeline schedule, with the pp strategy
    virtual_stages: int | None = None
    remat: str = "none"  # which of each layer's activations the backward keeps (core/remat.py)
    precision: str = "fp32"  # the compute dtype: fp32, bf16, fp16 (core/precision.py)
    offload: bool = False  # AdamW's states in host memory between steps (JAX)
    eval_every: int = 50
    eval_batches: int = 8
    data: tuple[str, ...] = ()  # files for the model's dataset (the GPT: text); empty: its default
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0  # save every K steps (and after the last); 0: never
    keep_last: int | None = 3  # committed checkpoints kept (None: all)
    collective_timeout: float = 600.0  # torch: seconds one collective (or a silent rank) may take


@dataclass(frozen=True)
class StepEvent:
    step: int
    loss: float


@dataclass(frozen=True)
class EvalEvent:
    step: int
    loss: float


@dataclass(frozen=True)
class CheckpointEvent:
    step: int
    path: str


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    evals: list[tuple[int, float]] = field(default_factory=list)
    seconds: float = 0.0
    first_step_s: float = 0.0  # includes compilation / process start
    last_step_s: float = 0.0
    steps_run: int = 0  # by this process (a resumed run: after the checkpoint)

    def examples_per_s(self, spec: TrainSpec) -> float:
        """Between the first step's end and the last's (evaluations included)."""
        steady = self.last_step_s - self.first_step_s
        n = self.steps_run - 1
        return n * spec.batch / steady if n > 0 and steady > 0 else 0.0


class TrainingDiverged(RuntimeError):
    """The loss stopped being a finite number."""


def make_train_program(spec: TrainSpec) -> Program:
    return program_from(spec.model, spec.strategy, Mesh(spec.mesh), batch=spec.batch, optimizer=spec.optimizer,
                        microbatches=spec.microbatches, schedule=spec.schedule, virtual=spec.virtual_stages,
                        remat=spec.remat, precision=spec.precision, offload=spec.offload)


def dataset_of(model, files=()):
    """The model's dataset (``model.dataset(files)``), or one clear error."""
    return model_dataset(model, files)


def model_meta(program: Program) -> dict:
    """How a checkpoint says which model it holds: the reference to rebuild it, the model's own
    description (if it has ``describe()``), every parameter's shape."""
    describe = getattr(program.model, "describe", None)
    return {"ref": program.model_ref, "describe": describe() if callable(describe) else None,
            "params": {k: list(v) for k, v in program.shapes.items()}}


def data_digests(files) -> list[str]:
    """The SHA-256 of each ``--data`` file (read in 1 MiB chunks), so a resume reads the same data."""
    import hashlib
    import os

    out = []
    for path in files:
        st = os.stat(path)
        key = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
        if key in _digested:  # the CLI's resume check, run_train's and the run itself: one read
            out.append(_digested[key])
            continue
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(2**20), b""):
                h.update(chunk)
        _digested[key] = h.hexdigest()
        out.append(_digested[key])
    return out


_digested: dict = {}


def _meta(spec: TrainSpec, program: Program, count: int, history: dict, source: str, digests: list,
          scaler=None) -> dict:
    """The run's state besides the tensors: what a resume on any backend needs."""
    prec = program.precision
    return {"count": count, "backend": spec.backend, "model": model_meta(program), "mesh": dict(spec.mesh),
            "strategy": program.strategy.name, "optimizer": asdict(spec.optimizer),
            "precision": {"policy": prec.name, "compute": prec.compute, "reductions": prec.reduce,
                          "masters": "float32", "loss_scale": scaler.state() if scaler is not None else None},
            "data": {"seed": spec.seed, "batch": spec.batch, "files": list(spec.data), "sha256": digests,
                     "source": source},
            "rng": {"seed": spec.seed, "streams": "training batch t: the dataset's batch_at(t, seed); held-out batch i: "
                                                  "batch_at(i, seed, held_out); dropout: (seed, update count, key, "
                                                  "element index)"},
            "losses": history["losses"], "evals": history["evals"]}


def _differences(saved: dict, want: dict) -> str:
    """"key saved vs wanted" for each key whose values differ."""
    return ", ".join(f"{k} {saved.get(k)!r} vs {want.get(k)!r}" for k in sorted(set(saved) | set(want))
                     if saved.get(k) != want.get(k))


def _check_model(ckpt, program: Program) -> None:
    from .checkpoint import CheckpointError

    saved, want = ckpt.meta("model"), model_meta(program)
    where = f"{ckpt.path}/manifest.json: field 'model'"
    if not isinstance(saved, dict):
        raise CheckpointError(f"{where} must be an object")
    kind = lambda d: d.get("kind") if isinstance(d, dict) else None
    if saved.get("ref") != want["ref"] and kind(saved.get("describe")) != kind(want["describe"]):
        raise CheckpointError(f"{where}: the checkpoint holds {saved.get('ref') or 'another model'}, not --model "
                              f"{want['ref']}" + (f"; resume with --model {saved['ref']}" if saved.get("ref") else ""))
    if saved.get("describe") is not None and want["describe"] is not None:
        a, b = saved["describe"], want["describe"]
        if a != b:
            if isinstance(a, dict) and isinstance(a.get("config"), dict) and isinstance(b.get("config"), dict):
                a, b = a["config"], b["config"]
            diff = _differences(a, b) if isinstance(a, dict) and isinstance(b, dict) else f"{a!r:.200} vs {b!r:.200}"
            raise CheckpointError(f"{where} differs from --model {program.model_ref}: {diff}")
    elif saved.get("params") != want["params"]:
        raise CheckpointError(f"{where}: the checkpoint holds {saved.get('ref') or 'another model'} with other "
                              f"parameters than --model {program.model_ref}; pass --model {saved.get('ref')}"
                              if saved.get("ref") else f"{where}: its parameters differ from --model's")


def check_init(ckpt, program: Program) -> None:
    """A checkpoint's parameters start this run only if its model is --model's."""
    _check_model(ckpt, program)
    ckpt.open_all()


def check_resume(ckpt, spec: TrainSpec, program: Program) -> None:
    """A checkpoint continues this run only with the same model, data (the --data files' SHA-256)
    and optimizer."""
    from .checkpoint import CheckpointError

    where = f"{ckpt.path}/manifest.json"
    _check_model(ckpt, program)
    saved = ckpt.meta("data")
    data = {k: saved.get(k) for k in ("seed", "batch", "files")}
    want = {"seed": spec.seed, "batch": spec.batch, "files": list(spec.data)}
    if data != want:
        raise CheckpointError(f"{where}: field 'data' is {data}; this run reads {want} (resume with the same "
                              f"--seed, --batch and --data)")
    listed = saved.get("sha256")
    if not (isinstance(listed, list) and len(listed) == len(spec.data) and all(isinstance(x, str) for x in listed)):
        raise CheckpointError(f"{where}: field 'data.sha256' must list one SHA-256 per --data file, not {listed!r:.80}")
    if ckpt.count() != ckpt.step:
        raise CheckpointError(f"{where}: the checkpoint holds parameters only (count {ckpt.count()} at step "
                              f"{ckpt.step}); start a new run from it with --init-from")
    changed = [f for f, a, b in zip(spec.data, listed, data_digests(spec.data)) if a != b]
    if changed:
        raise CheckpointError(f"{where}: --data {changed[0]!r} changed since the checkpoint was saved (its SHA-256 "
                              f"differs); resume with the file as it was, or start a new run")
    saved, want = ckpt.meta("optimizer"), asdict(spec.optimizer)
    if saved != want:
        diff = _differences(saved, want)
        hint = (" (the cosine schedule ends at the run's --steps: resume with the same --steps; a run trained with "
                "--no-cosine can be extended)") if saved.get("decay_steps") != want.get("decay_steps") else ""
        raise CheckpointError(f"{where}: field 'optimizer' differs from this run's: {diff}{hint}")
    if ckpt.step >= spec.steps:
        raise CheckpointError(f"{where}: the checkpoint is already at step {ckpt.step} and --steps is {spec.steps}: "
                              f"nothing left to train")
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


def _history(ckpt) -> dict:
    return {"losses": list(ckpt.meta("losses")), "evals": [list(e) for e in ckpt.meta("evals")]}


def train_loop(session, spec: TrainSpec, resume: str | None, init_from: str | None, run: dict) -> None:
    """In every process of the run: restore, then steps ``start+1 .. spec.steps``; held-out
    evaluations every ``eval_every`` steps; a checkpoint every ``checkpoint_every``. ``run``: the
    run's id and its data files' digests (the same in every process)."""
    from . import checkpoint

    program = session.program
    ckpt = checkpoint.Checkpoint(resume) if resume else None
    if ckpt:
        session.restore(ckpt)
        saved = ckpt.manifest.get("precision") or {}
        scaler = getattr(session, "scaler", None)
        if scaler is not None and saved.get("loss_scale"):  # fp16's dynamic scale goes on where it was
            scaler.load(saved["loss_scale"])
    elif init_from:
        session.restore(checkpoint.Checkpoint(init_from), params_only=True)
    start = ckpt.step if ckpt else 0
    history = _history(ckpt) if ckpt else {"losses": [], "evals": []}
    data = dataset_of(program.model, spec.data)
    evalset = [data.batch_at(i, spec.batch, seed=spec.seed, split=Split.HELD_OUT) for i in range(spec.eval_batches)]
    for t in range(start, spec.steps):
        loss = session.step(data.batch_at(t, spec.batch, seed=spec.seed))
        if not math.isfinite(loss):
            raise TrainingDiverged(f"step {t + 1}: the loss is {loss}; training diverged (lower --lr, or check the "
                                   f"data and the checkpoint it started from)")
        history["losses"].append(loss)
        session.emit(StepEvent(t + 1, loss))
        if spec.eval_batches and ((t + 1) % spec.eval_every == 0 or t + 1 == spec.steps):
            ev = float(np.mean([session.eval_loss(b) for b in evalset]))
            history["evals"].append([t + 1, ev])
            session.emit(EvalEvent(t + 1, ev))
        if spec.checkpoint_dir and spec.checkpoint_every and ((t + 1) % spec.checkpoint_every == 0 or t + 1 == spec.steps):
            tensors, blocks, count = session.checkpoint_tensors()
            path = save_checkpoint(spec, program, t + 1, tensors, blocks, count, history, dataset_source(data),
                                   run, lead=session.lead, barrier=session.barrier,
                                   scaler=getattr(session, "scaler", None))
            session.emit(CheckpointEvent(t + 1, str(path)))


def save_checkpoint(spec: TrainSpec, program: Program, step: int, tensors, blocks, count: int, history: dict,
                    source: str, run: dict, *, lead: bool = True, barrier=lambda: None, scaler=None):
    """Save the run's state after update ``step`` into ``spec.checkpoint_dir`` (every process
    calls it with the blocks it holds): tensors and blocks as ``checkpoint.save`` takes them, the
    update ``count``, the loss ``history`` ({"losses", "evals"}), the dataset's ``source`` and
    ``run`` ({"id", "data_sha256"}); refused where a block is not finite. Returns the folder."""
    from . import checkpoint

    if not all(np.isfinite(a).all() for b in blocks.values() for a in b.values()):
        raise TrainingDiverged(f"step {step}: the parameters or optimizer states are no longer finite; "
                               f"no checkpoint saved (lower --lr)")
    meta = _meta(spec, program, count, history, source, run["data_sha256"], scaler)
    checkpoint.save(spec.checkpoint_dir, step, tensors, blocks, meta, run=run["id"], lead=lead, barrier=barrier,
                    keep_last=spec.keep_last, crash_hook=_crash_hook(step))
    return checkpoint.step_dir(spec.checkpoint_dir, step)


def run_train(spec: TrainSpec, on_event: Callable = lambda e: None, *, resume=None, init_from=None,
              program: Program | None = None) -> TrainResult:
    """Train, continuing the checkpoint ``resume`` or starting from the parameters of
    ``init_from`` (folders or ``Checkpoint``s); ``on_event`` sees every ``StepEvent``,
    ``EvalEvent`` and ``CheckpointEvent`` (in this process, whichever backend runs). The run
    holds ``spec.checkpoint_dir``'s lock throughout (``checkpoint.locked``)."""
    from .checkpoint import Checkpoint, locked, new_run_id

    program = program or make_train_program(spec)
    as_checkpoint = lambda c: c if c is None or isinstance(c, Checkpoint) else Checkpoint(c)
    ckpt, init = as_checkpoint(resume), as_checkpoint(init_from)
    result = TrainResult()
    start = time.perf_counter()
    if init:
        check_init(init, program)
    if ckpt:
        check_resume(ckpt, spec, program)
        history = _history(ckpt)
        result.losses, result.evals = list(history["losses"]), [tuple(e) for e in history["evals"]]
    first = (ckpt.step if ckpt else 0) + 1

    def record(event):
        if isinstance(event, StepEvent):
            result.losses.append(event.loss)
            result.steps_run += 1
            result.last_step_s = time.perf_counter() - start
            if event.step == first:
                result.first_step_s = time.perf_counter() - start
        elif isinstance(event, EvalEvent):
            result.evals.append((event.step, event.loss))
        on_event(event)

    with locked(spec.checkpoint_dir) if spec.checkpoint_dir else contextlib.nullcontext():
        get_backend(spec.backend).run(program, train_loop, spec,
                                      *(None if c is None else str(c.path) for c in (ckpt, init)),
                                      {"id": new_run_id(), "data_sha256": data_digests(spec.data)}, seed=spec.seed, on_event=record, timeout_s=spec.collective_timeout)
    result.seconds = time.perf_counter() - start
    return result


def spec_json(spec: TrainSpec) -> dict:
    out = asdict(spec)
    out["mesh"] = dict(spec.mesh)
    out["data"] = list(spec.data) or "the model's default dataset"
    return out
