"""Mixed precision: the dtype a program computes in, the dtype its sums run in, and fp16's loss
scaling, stated once in the ``Program`` and kept by every backend.

A policy has three parts:

- **parameters, master weights and optimizer states** are float32, in their own layouts, always
  (AdamW's moments and the update are never rounded to 16 bits);
- **compute** (``fp32``, ``bf16``, ``fp16``): every op's floating operands are cast to it where the
  op computes (torch.autocast's rule, not a cast of the stored weights), so a parameter's
  gradient flows back through the cast into its float32 master;
- **reductions** run in float32: layer and RMS norm statistics, softmax (attention's included) and
  the loss compute in float32 and hand back the compute dtype (the loss stays float32); and every
  collective that sums, in either direction (an all-reduce of pending sums, the reduce-scatter
  that is an all-gather's transpose, the all-reduce that is ``vary``'s), sends float32. A
  parameter meets the compute dtype only after its collectives, so data-parallel and FSDP
  gradient sums are float32 sums of float32 values; an activation in the compute dtype is
  widened for the collective and rounded back once after it.

``bf16-sum16`` is Megatron-LM's policy for the sums of activations: bf16 compute, and every
collective that sums an activation (a tensor-parallel all-reduce or reduce-scatter, the backward
of an activation's all-gather or ``vary``) sends bfloat16, half float32's bytes, rounded at each
sum. A parameter's collectives and its gradient's sums stay float32 (they run before its cast),
as do the norms' and softmax's statistics and the loss. Opt-in: ``parlay plan --devices``
searches it beside ``bf16`` and says which it picked.

``fp16`` adds dynamic loss scaling (``LossScale``): the loss is multiplied by the scale before the
backward and the gradients divided by it before clipping; a step whose gradients hold an inf or a
NaN is skipped (no update, the count does not advance) and the scale halves; after
``growth_interval`` finite steps in a row it doubles. bf16 has float32's exponent range and needs
none.

What this does not do: gather parameters in 16 bits (FSDP2's ``param_dtype``), which halves the
gather's bytes but makes its transpose a 16-bit reduce-scatter unless the collective is custom;
here the sums being float32 comes first. The numpy simulator computes in float32 only (numpy's
einsum has no bfloat16).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Precision", "LossScale", "PRECISIONS", "parse_precision", "FP32"]


@dataclass(frozen=True)
class Precision:
    """``compute``: numpy-style dtype name the ops compute in; ``reduce``: the dtype of the norms',
    softmax's and the loss's statistics; ``sums``: the dtype an activation's summing collectives
    send (float32, or the compute dtype: ``bf16-sum16``); ``loss_scale``: fp16's initial dynamic
    scale (None: no scaling)."""

    name: str
    compute: str
    reduce: str = "float32"
    sums: str = "float32"
    loss_scale: float | None = None
    growth_interval: int = 2000  # finite steps before the scale doubles (torch's GradScaler default)

    @property
    def mixed(self) -> bool:
        return self.compute != "float32"

    @property
    def dtype(self) -> str | None:
        """What the ops are given (``DenseOps``/``ShardedOps``' ``dtype``): None where nothing is cast."""
        return self.compute if self.mixed else None

    @property
    def narrow_sums(self) -> bool:
        """Whether an activation's collectives sum in the compute dtype (not widened to float32)."""
        return self.mixed and self.sums == self.compute

    @property
    def compute_itemsize(self) -> int:
        return 4 if self.compute == "float32" else 2

    def describe(self) -> str:
        if not self.mixed:
            return "fp32"
        scale = f", dynamic loss scale from {self.loss_scale:g}" if self.loss_scale else ""
        if self.narrow_sums:
            return (f"{self.name} (compute {self.compute}, activation sums {self.sums}, gradient sums and masters "
                    f"float32{scale})")
        return f"{self.name} (compute {self.compute}, sums and masters float32{scale})"


FP32 = Precision("fp32", "float32")
PRECISIONS = {
    "fp32": FP32,
    "bf16": Precision("bf16", "bfloat16"),
    "bf16-sum16": Precision("bf16-sum16", "bfloat16", sums="bfloat16"),
    "fp16": Precision("fp16", "float16", loss_scale=2.0 ** 15),
}


def parse_precision(precision) -> Precision:
    if isinstance(precision, Precision):
        return precision
    key = str(precision).lower()
    if key not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is unknown; choose from {', '.join(PRECISIONS)}.")
    return PRECISIONS[key]


@dataclass
class LossScale:
    """fp16's dynamic loss scale (torch.amp.GradScaler's rule): ``update(finite)`` after each step
    says whether the step's update is taken and moves the scale."""

    scale: float
    growth_interval: int = 2000
    good: int = 0  # finite steps since the scale last changed
    skipped: int = 0  # steps skipped for overflow, in all

    def update(self, finite: bool) -> bool:
        if not finite:
            self.scale, self.good, self.skipped = self.scale * 0.5, 0, self.skipped + 1
            return False
        self.good += 1
        if self.good >= self.growth_interval:
            self.scale, self.good = self.scale * 2.0, 0
        return True

    @classmethod
    def of(cls, precision: Precision) -> "LossScale | None":
        if precision.loss_scale is None:
            return None
        return cls(float(precision.loss_scale), precision.growth_interval)

    def state(self) -> dict:
        return {"scale": self.scale, "good": self.good, "skipped": self.skipped}

    def load(self, state: dict) -> None:
        self.scale, self.good, self.skipped = float(state["scale"]), int(state["good"]), int(state["skipped"])
        if not math.isfinite(self.scale) or self.scale <= 0:
            raise ValueError(f"a checkpoint's loss scale {self.scale!r} must be a positive finite number.")
