"""One contract for running a ``Program`` on any backend: ``Session``, ``Backend`` and a lazy
registry by name.

A ``Backend`` starts a run (torch: one gloo process per rank; JAX and numpy: this process) and
calls ``fn(session, *args)`` where the program runs; a ``Session`` is the running model: its
parameters and optimizer state, a training step, the loss and gradients of a batch, checkpoint
tensors, a recording of every op for the bisect. The commands (``compare``, ``train``, ``step``)
are written once against these and import no backend; ``get_backend(name)`` imports one on use.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Mapping, Protocol

import numpy as np

from .executor import Sharded, ShardedOps, group_members
from .ops import DropoutKey
from .program import Program
from .ring import seq_dim
from .spec import Layout
from .strategies import Role

__all__ = ["Session", "Backend", "BACKENDS", "get_backend", "sharded_params", "sharded_inputs", "microbatches",
           "input_values", "check_batch", "in_order", "make_executor", "scalar_loss", "LossVaries", "RunFailure"]


class Session(Protocol):
    program: Program
    rank: int  # this process's rank (0 where one process runs the whole mesh)
    lead: bool  # the process that reports, and commits checkpoints

    def step(self, batch: Mapping[str, np.ndarray]) -> float:
        """Forward, backward, clipping, one AdamW update; the loss."""

    def eval_loss(self, batch: Mapping[str, np.ndarray]) -> float:
        """The loss alone, dropout off."""

    def loss_and_grads(self, batch: Mapping[str, np.ndarray]) -> tuple[float, dict[str, np.ndarray]]:
        """The loss and every parameter's global gradient (on the lead; no update)."""

    def params(self) -> dict[str, np.ndarray]:
        """Every parameter as a global array (on the lead)."""

    def checkpoint_tensors(self) -> tuple[list, dict, int]:
        """(tensors, blocks, count): (name, shape, layout text, pieces) of every parameter and
        AdamW moment, the blocks this process writes (file -> {key: array}), the update count."""

    def restore(self, ckpt, params_only: bool = False) -> None:
        """Parameters (and AdamW moments and count) from a checkpoint of any backend, strategy or mesh."""

    def trace(self, batch: Mapping[str, np.ndarray]) -> list:
        """One forward recorded op by op (``core.trace.Probe`` with global values; on an explicit
        executor every plan step checked against the simulator). The lead has them."""

    def barrier(self) -> None: ...

    def emit(self, event: Any) -> None:
        """Hand a progress event to the caller of ``Backend.run`` (from the lead only)."""


class Backend(Protocol):
    name: str

    def prepare(self, mesh) -> None:
        """Check the machine can run a mesh this size (one clear error if not) and set what must
        be set before the framework starts (JAX's host device count)."""

    def run(self, program: Program, fn: Callable, *args, params: Mapping[str, np.ndarray] | None = None,
            seed: int = 0, on_event: Callable | None = None, timeout_s: float = 600.0) -> Any:
        """``fn(session, *args)`` wherever the program runs; the lead's result. Parameters start
        at ``params`` (global numpy arrays) or the model's ``init(seed)``."""


# name -> (module, factory, keyword arguments)
_REGISTRY: dict[str, tuple[str, str, dict]] = {
    "torch": ("parlay.backends.torch.session", "TorchBackend", {}),
    "jax": ("parlay.backends.jax.session", "JaxBackend", {"mode": "explicit"}),
    "jax-gspmd": ("parlay.backends.jax.session", "JaxBackend", {"mode": "gspmd"}),
    # explicit mode, a pipeline as one jitted program per stage driven from Python (any stage shapes)
    "jax-mpmd": ("parlay.backends.jax.session", "JaxBackend", {"mode": "explicit", "pipeline": "mpmd"}),
    "numpy": ("parlay.backends.numpy.session", "NumpyBackend", {}),
    # one device, no sharding: the references
    "jax-single": ("parlay.backends.jax.session", "JaxBackend", {"mode": "single"}),
    "torch-single": ("parlay.backends.torch.session", "TorchBackend", {"single": True}),
    "numpy-single": ("parlay.backends.numpy.session", "NumpyBackend", {"single": True}),
}
BACKENDS = ("torch", "jax", "jax-gspmd", "numpy")


def get_backend(name: str) -> Backend:
    """The backend called ``name`` (imported now)."""
    if name not in _REGISTRY:
        raise ValueError(f"backend {name!r} is unknown; choose from {', '.join(_REGISTRY)}.")
    module, factory, kwargs = _REGISTRY[name]
    return getattr(importlib.import_module(module), factory)(name=name, **kwargs)


class RunFailure(RuntimeError):
    """A run's process failed, died or timed out (the backend says which and why)."""


# What a process that died before it started most likely means (torch's ranks, the search's workers).
MAIN_GUARD = ("if it printed \"An attempt has been made to start a new process before the current process has "
              "finished its bootstrapping phase\", the script starts parlay's processes at its top level: each "
              "spawned process imports the script again and runs that line too. Put the call under "
              "`if __name__ == \"__main__\":`. If it printed \"Can't get attribute ... on <module '__main__'>\", "
              "the function it runs is defined where a spawned process cannot import it (a notebook, `python -c`): "
              "define it in a module file")


# -- what every executor-based session does the same way ----------------------------------------------

class LossVaries(ValueError):
    """The model's loss is not a scalar: a reduction is missing."""


def sharded_params(program: Program, blocks: Mapping[str, Any]) -> dict[str, Sharded]:
    """This rank's stored parameter blocks as ``Sharded`` values (named, for gradient buckets)."""
    out = {}
    for d in program.decls:
        layout = program.layouts[Role.PARAMS][d.name]
        out[d.name] = Sharded(blocks[d.name], layout, d.shape, frozenset(layout.spec.axes), d.name)
    return out


def input_values(program: Program, blocks: Mapping[str, Any]) -> dict[str, Sharded]:
    """This rank's input blocks as ``Sharded`` values."""
    out = {}
    for name, d in program.inputs.items():
        layout = program.layouts[Role.ACTIVATIONS][name]
        out[name] = Sharded(blocks[name], layout, d.shape, frozenset(layout.spec.axes))
    return out


def check_batch(program: Program, batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The batch's arrays in the dtypes the model declares, every input present with its shape."""
    missing = sorted(set(program.inputs) - set(batch))
    if missing:
        raise ValueError(f"the batch lacks input {missing[0]!r}; the model's inputs are {sorted(program.inputs)}.")
    out = {}
    for name, d in program.inputs.items():
        x = np.asarray(batch[name])
        if x.shape != d.shape:
            raise ValueError(f"input {name!r} has shape {x.shape}; the program expects {d.shape} (batch "
                             f"{program.batch}).")
        out[name] = x.astype(d.dtype.numpy, copy=False)
    return out


def in_order(program: Program, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The inputs with their ``seq`` dim in the program's zigzag order (core/ring.py), for the
    explicit lowerings (the executor's ops follow the order); unchanged without one."""
    order = program.seq_order
    if order is None:
        return dict(arrays)
    out = {}
    for name, x in arrays.items():
        d = seq_dim(program.inputs[name].dims)
        out[name] = x if d is None else np.take(x, order.perm, axis=d)
    return out


def sharded_inputs(program: Program, batch: Mapping[str, np.ndarray], place: Callable[[np.ndarray, Layout], Any]
                   ) -> dict[str, Sharded]:
    """``place(global array, layout)`` -> this rank's block, for every input the model declares
    (in the program's sequence order)."""
    arrays = in_order(program, check_batch(program, batch))
    return input_values(program, {k: place(v, program.layouts[Role.ACTIVATIONS][k]) for k, v in arrays.items()})


def make_executor(program: Program, comm, params: Mapping[str, Sharded], *, coalesce: bool = True, hooks=None,
                  training: bool = True, step: Any = 0, seed: int = 0, rows: tuple = (1, 0)) -> ShardedOps:
    """The executor of one forward: the program's layouts, FSDP's per-block gathers where
    ``coalesce``, dropout keyed by (seed, step)."""
    from .executor import Hooks

    hooks = Hooks() if hooks is None else hooks
    if hooks.fault is None and program.fault is not None:
        hooks = dataclasses.replace(hooks, fault=program.fault)  # the caller's Hooks stay as they were
    return ShardedOps(comm, activation=program.activation, compute=program.compute,
                      groups=group_members(params, program.dims) if coalesce else None, hooks=hooks,
                      training=training, rng=DropoutKey(seed, step, rows=rows), dtype=program.precision.dtype,
                      order=program.seq_order, narrow_sums=program.precision.narrow_sums)


def scalar_loss(ops: ShardedOps, loss: Any) -> Any:
    """The local value of the model's loss, checked to be a scalar, its pending sums added and
    the same on every rank (``ShardedOps.finish_loss``)."""
    if not isinstance(loss, Sharded):
        raise TypeError(f"model.loss returned {type(loss).__name__}; it must return the result of an op.")
    if loss.shape != ():
        raise LossVaries(f"the loss has shape {loss.shape}: it still holds a value per position; loss(ops, params, "
                         f"batch) must reduce it to a scalar (ops.mean, ops.sum, ops.cross_entropy).")
    return ops.finish_loss(loss).local


def microbatches(program: Program, batch: Mapping[str, np.ndarray]) -> list[tuple[dict[str, np.ndarray], tuple]]:
    """A step's batch as ``program.microbatches`` microbatches: (arrays of microbatch i, its dropout
    rows ``(k, i)``). Microbatch i is rows i, i+k, i+2k, ... of every input, so each rank's block of
    it is the same rows of the rank's own block. Each microbatch's loss is weighted 1/k once, before
    its backward: the model's loss is a mean over the examples, and every microbatch holds the same
    number of them, so the sum is the whole batch's mean (no per-microbatch renormalisation)."""
    k = program.microbatches
    arrays = check_batch(program, batch)
    if k == 1:
        return [(arrays, (1, 0))]
    return [({name: np.ascontiguousarray(x[i::k]) for name, x in arrays.items()}, (k, i)) for i in range(k)]
