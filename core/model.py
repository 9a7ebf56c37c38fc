"""What a model must provide to run on parlay: the ``Model`` protocol (and its data).

A model is any object with

- ``decls()``: its parameters, as ``ParamDecl`` (name, global shape, one logical dim name or None
  per dim, initializer);
- ``inputs(batch)``: the arrays one training step reads (targets included), as ``InputDecl`` by
  name: global shape for a batch of ``batch`` examples, logical dims, dtype. The first dim of
  every input is the batch dim, whatever the model calls it;
- ``loss(ops, params, batch)``: the scalar loss, written against the neutral ``Ops``; ``params``
  maps each declared name to a tensor of the backend, ``batch`` each input name.

and optionally

- ``init(seed)``: numpy float32 parameters (default: ``init_params(decls(), seed)``);
- ``dataset(files)``: a ``Dataset`` to train and evaluate on (``parlay train`` needs one; without
  it, ``compare`` and ``step`` draw random inputs from the ``InputDecl``s);
- ``describe()``: a JSON-able dict that says which model this is (a checkpoint records it).

The GPT (``parlay.core.models.gpt``) meets it, and so does the ViT-style encoder in
``examples/vit.py``. Nothing in parlay is typed to a particular model.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from .layers import ParamDecl, init_params
from .ops import Ops

__all__ = ["DType", "Split", "InputDecl", "Model", "Dataset", "RandomData", "model_init", "check_model",
           "dataset_source", "model_dataset"]


class DType(enum.Enum):
    INT32 = "int32"
    FLOAT32 = "float32"

    @property
    def numpy(self):
        return np.dtype(self.value)


class Split(enum.Enum):
    TRAIN = "train"
    HELD_OUT = "held_out"


@dataclass(frozen=True, slots=True)
class InputDecl:
    """One input array of a training step: global shape, logical dims, dtype. ``high``: integer
    inputs lie in ``[0, high)`` (a vocabulary size, a number of classes): required for them,
    since random batches are drawn there."""

    shape: tuple[int, ...]
    dims: tuple[str | None, ...]
    dtype: DType
    high: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))
        object.__setattr__(self, "dims", tuple(None if d is None else str(d) for d in self.dims))
        if not isinstance(self.dtype, DType):
            raise TypeError(f"InputDecl dtype {self.dtype!r} must be a DType ({', '.join(f'DType.{m.name}' for m in DType)}).")
        if len(self.shape) != len(self.dims) or not self.shape:
            raise ValueError(f"InputDecl: shape {self.shape} and logical dims {self.dims} must have the same, non-zero "
                             f"number of dims (the first is the batch dim).")
        if self.dtype is DType.INT32 and (not isinstance(self.high, int) or isinstance(self.high, bool) or self.high < 1):
            raise ValueError(f"InputDecl {self.shape} of int32: give high= (its values lie in [0, high), e.g. the "
                             f"number of classes), got high={self.high!r}.")


@runtime_checkable
class Model(Protocol):
    def decls(self) -> Sequence[ParamDecl]: ...

    def inputs(self, batch: int) -> Mapping[str, InputDecl]: ...

    def loss(self, ops: Ops, params: Mapping[str, Any], batch: Mapping[str, Any]) -> Any: ...


class Dataset(Protocol):
    """Batches indexed by step: ``batch_at(t, batch, seed=..., split=...)`` returns one array per
    input the model declares and is a function of (seed, t, split) alone, so a resumed run on any
    backend reads what the uninterrupted one read. Optional: ``source`` (a short name),
    ``describe()`` (a line for the log), ``baseline()`` ((name, loss) to compare with, e.g. the
    unigram entropy or a uniform guess)."""

    def batch_at(self, step: int, batch: int, *, seed: int, split: Split = Split.TRAIN) -> dict[str, np.ndarray]: ...


def model_dataset(model: Model, files: Sequence[str] = (), *, random: bool = False):
    """``model.dataset(files)``; where the model has none, random inputs (``random``) or one error."""
    make = getattr(model, "dataset", None)
    if callable(make):
        return make(tuple(files))
    if random:
        return RandomData(model)
    raise ValueError(f"model {type(model).__name__} has no dataset(): parlay train needs one (parlay compare and "
                     f"parlay step draw random inputs instead); see parlay.core.model.")


def dataset_source(data) -> str:
    return str(getattr(data, "source", None) or type(data).__name__)


class RandomData:
    """Random inputs drawn from a model's ``InputDecl``s: ints in ``[0, high)``, floats normal."""

    def __init__(self, model: Model):
        self.model, self.source = model, "random inputs"

    def batch_at(self, step: int, batch: int, *, seed: int, split: Split = Split.TRAIN) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([seed, step, split is Split.TRAIN])
        out = {}
        for name, d in self.model.inputs(batch).items():
            if d.dtype is DType.INT32:
                out[name] = rng.integers(0, d.high, d.shape).astype(np.int32)
            else:
                out[name] = rng.standard_normal(d.shape).astype(np.float32)
        return out


def model_init(model: Model, seed: int) -> dict[str, np.ndarray]:
    """``model.init(seed)`` where the model has one, else ``init_params(model.decls(), seed)``."""
    init = getattr(model, "init", None)
    return init(seed) if callable(init) else init_params(tuple(model.decls()), seed)


def check_model(model: object, *, where: str = "model") -> Model:
    """``model`` if it meets the Model protocol, else one TypeError saying what is missing."""
    missing = [m for m in ("decls", "inputs", "loss") if not callable(getattr(model, m, None))]
    if missing:
        raise TypeError(f"{where} is {type(model).__name__}, which lacks {', '.join(f'{m}()' for m in missing)}; a "
                        f"parlay model provides decls(), inputs(batch) and loss(ops, params, batch) (see "
                        f"parlay.core.model).")
    return model  # type: ignore[return-value]
