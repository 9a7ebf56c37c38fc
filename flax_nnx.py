"""Flax NNX and parlay, in one place for a Flax user.

- NNX models under parlay's strategies: ``NnxModel``, ``constrain``, and Flax's logical-axis rule
  lists as parlay ``Rules`` (``rules_from_flax``, ``rules_to_flax``, ``strategy_from_flax``,
  ``strategy_to_flax``): backends/jax/nnx.py.
- parlay's layers and models as NNX modules: ``Layer``, ``Model``, ``GPT``, ``Placement``, and
  parlay's optimizer as optax (``adamw``): backends/jax/nnx_modules.py.
- Checkpoints between an NNX loop and parlay's runs (here: they need the top level's checkpoint and
  run code, which the backends do not import): ``save_checkpoint`` writes a module and its
  ``nnx.Optimizer`` as a parlay checkpoint that ``parlay train --resume`` continues on any backend;
  ``load_checkpoint`` reads one saved by any backend into a module and its optimizer.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

from .backends.jax.nnx import NnxModel, constrain, rules_from_flax, rules_to_flax, strategy_from_flax, strategy_to_flax
from .backends.jax.nnx_modules import GPT, Layer, Model, Placement, adamw, adamw_config, checkpoint_tensors, restore
from .checkpoint import Checkpoint, CheckpointError, new_run_id
from .core.model import dataset_source
from .core.optim import OptimizerConfig
from .core.program import make_program
from .training import TrainSpec, data_digests, dataset_of, make_train_program, model_meta
from .training import save_checkpoint as _save

__all__ = ["NnxModel", "constrain", "rules_from_flax", "rules_to_flax", "strategy_from_flax", "strategy_to_flax",
           "Layer", "Model", "GPT", "Placement", "adamw", "OptimizerConfig", "TrainSpec", "dataset_of",
           "save_checkpoint", "load_checkpoint"]


def _a_model(module, what: str) -> None:
    if not isinstance(module, Model):
        raise TypeError(f"{what} takes a parlay model as an NNX module (parlay.flax_nnx.Model or GPT), not "
                        f"{type(module).__name__}; your own NNX module trains and checkpoints through parlay as an "
                        f"NnxModel (parlay train --model FILE.py:NAME)")


def save_checkpoint(spec: TrainSpec, module: Model, optimizer, losses: Sequence[float], *,
                    evals: Sequence[tuple[int, float]] = ()) -> Path:
    """Write ``module`` and ``optimizer`` (an ``nnx.Optimizer`` of ``adamw(spec.optimizer)``) after
    ``len(losses)`` updates as a parlay checkpoint in ``spec.checkpoint_dir``, which ``parlay train
    --resume`` (or ``run_train(spec, resume=...)``) continues on any backend, strategy and mesh.
    ``spec`` is the ``TrainSpec`` the run is to continue under: its model, data, seed, batch and
    optimizer must be the ones the NNX loop used (batch ``t`` is ``dataset.batch_at(t, spec.batch,
    seed=spec.seed)``), since the resume checks them. The tensors are written in the module's own
    layouts, and the manifest says the steps ran on ``jax-nnx`` under its strategy and mesh.
    ``evals``: (step, held-out loss) pairs for the history. Returns the checkpoint's folder."""
    if not isinstance(spec, TrainSpec):
        raise TypeError(f"save_checkpoint(spec, module, optimizer, losses): spec is a TrainSpec, not "
                        f"{type(spec).__name__}")
    _a_model(module, "save_checkpoint")
    if not spec.checkpoint_dir:
        raise ValueError("save_checkpoint: the TrainSpec has no checkpoint_dir")
    used = adamw_config(optimizer)
    if used != spec.optimizer:
        diff = ", ".join(f"{k} {getattr(used, k)!r} vs {getattr(spec.optimizer, k)!r}"
                         for k in OptimizerConfig.__dataclass_fields__ if getattr(used, k) != getattr(spec.optimizer, k))
        raise ValueError(f"save_checkpoint: the optimizer's adamw config differs from spec.optimizer ({diff}); the "
                         f"run continues with spec.optimizer, so the NNX loop must have stepped with it")
    if module.placement is not None and module.placement.program.batch != spec.batch:
        raise ValueError(f"save_checkpoint: the module is placed for batches of {module.placement.program.batch} "
                         f"but spec.batch is {spec.batch}; the run continues with spec.batch, so the NNX loop must "
                         f"have taken batches of it")
    program = make_train_program(spec)  # the run to continue: its model, data and optimizer
    ours, theirs = model_meta(program)["describe"], getattr(module.model, "describe", lambda: None)()
    names = {d.name for d in module.model.decls()}
    if ours != theirs or set(program.shapes) != names:
        a, b = (d.get("config") if isinstance(d, dict) else None for d in (theirs, ours))
        diff = (", ".join(f"{k} {a.get(k)!r} vs {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))
                if isinstance(a, dict) and isinstance(b, dict) else f"{theirs!r:.120} vs {ours!r:.120}")
        raise ValueError(f"save_checkpoint: the module's model is not spec.model {spec.model!r} (module vs spec: "
                         f"{diff}); give the TrainSpec of the module's model")
    if int(optimizer.step[...]) != len(losses):
        raise ValueError(f"save_checkpoint: the optimizer took {int(optimizer.step[...])} updates but {len(losses)} "
                         f"losses are given; pass one loss per update")
    tensors, blocks, count, ran = checkpoint_tensors(module, optimizer, spec.batch)
    data = dataset_of(program.model, spec.data)
    history = {"losses": [float(x) for x in losses], "evals": [[int(s), float(e)] for s, e in evals]}
    here = dataclasses.replace(spec, backend="jax-nnx", strategy=ran.strategy.name, mesh=tuple(ran.mesh.axes))
    meta_program = make_program(program.model, ran.strategy, ran.mesh, batch=spec.batch, optimizer=spec.optimizer,
                                model_ref=program.model_ref)  # what the manifest says ran, under the run's model ref
    return _save(here, meta_program, count, tensors, blocks, count, history, dataset_source(data),
                 {"id": new_run_id(), "data_sha256": data_digests(spec.data)})


def load_checkpoint(module: Model, path, optimizer=None) -> int:
    """Read a parlay checkpoint (saved by any backend, in any layout) into ``module``, each
    parameter in the sharding it has; with ``optimizer`` (an ``nnx.Optimizer`` of
    ``adamw(config)``), Adam's moments and the update count too, so the NNX loop continues the run
    (its data, seed, batch and optimizer are then the loop's to follow: the manifest lists them).
    Returns the update count."""
    _a_model(module, "load_checkpoint")
    if optimizer is not None:
        adamw_config(optimizer)  # parlay's AdamW states, or an error before anything is read
    ckpt = path if isinstance(path, Checkpoint) else Checkpoint(path)
    names = {d.name for d in module.model.decls()}
    saved = {n.split("/", 1)[1] for n in ckpt.tensors if n.startswith("params/")}
    if names != saved:
        raise CheckpointError(f"{ckpt.path}: the checkpoint's parameters differ from the module's (only in the "
                              f"checkpoint: {sorted(saved - names)[:4]}; only in the module: {sorted(names - saved)[:4]})")
    if optimizer is not None and not all(f"opt/{k}/{n}" in ckpt.tensors for n in names for k in ("mu", "nu")):
        raise CheckpointError(f"{ckpt.path} holds no optimizer states (a checkpoint of parameters only); load it "
                              f"without the optimizer")
    ckpt.open_all()
    restore(module, ckpt, optimizer)
    return ckpt.count()
