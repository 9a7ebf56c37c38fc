"""The optimizer both backends run: AdamW with global-norm clipping and a warmup-cosine learning
rate, described once so that torch and JAX take the same steps (and a checkpoint resumes on either)."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["OptimizerConfig"]


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip: float = 1.0
    warmup: int = 0  # linear warmup over this many updates
    decay_steps: int = 0  # cosine decay to min_lr_ratio * lr at this update (0: no decay)
    min_lr_ratio: float = 0.1

    def __post_init__(self):
        bad = [k for k in ("lr", "beta1", "beta2", "eps", "weight_decay", "clip", "min_lr_ratio")
               if not math.isfinite(getattr(self, k))]
        if bad:
            raise ValueError(f"OptimizerConfig: {bad[0]}={getattr(self, bad[0])!r} must be a finite number.")
        problems = [f"{k}={getattr(self, k)!r} must be >= 0" for k in ("lr", "eps", "weight_decay", "clip", "warmup",
                                                                       "decay_steps") if getattr(self, k) < 0]
        problems += [f"{k}={getattr(self, k)!r} must be in [0, 1)" for k in ("beta1", "beta2")
                     if not 0 <= getattr(self, k) < 1]
        if 0 < self.decay_steps <= self.warmup:
            problems.append(f"decay_steps={self.decay_steps} must be past warmup={self.warmup} (0: no decay)")
        if not 0 <= self.min_lr_ratio <= 1:
            problems.append(f"min_lr_ratio={self.min_lr_ratio!r} must be in [0, 1]")
        if problems:
            raise ValueError("OptimizerConfig: " + "; ".join(problems) + ".")

    @property
    def constant(self) -> bool:
        return self.warmup == 0 and self.decay_steps == 0

    def lr_at(self, t, xp=math):
        """The learning rate of update ``t`` (0-based); ``xp`` is ``math`` or ``jax.numpy`` (traced)."""
        lr = self.lr
        if self.warmup:
            lr = lr * xp.minimum(1.0, (t + 1) / self.warmup) if xp is not math else lr * min(1.0, (t + 1) / self.warmup)
        if self.decay_steps > self.warmup:
            span = self.decay_steps - self.warmup
            if xp is math:
                progress = min(max((t - self.warmup) / span, 0.0), 1.0)
            else:
                progress = xp.clip((t - self.warmup) / span, 0.0, 1.0)
            lr = lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + xp.cos(math.pi * progress)))
        return lr
