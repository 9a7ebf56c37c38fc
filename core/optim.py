"""The optimizer both backends run: AdamW with global-norm clipping and a warmup-cosine learning
rate, described once so that torch and JAX take the same steps (and a checkpoint resumes on either)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

__all__ = ["OptimizerConfig", "AdamState", "adamw_update", "clip_scale"]


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

    def lr_at(self, t: int) -> float:
        """The learning rate of update ``t`` (0-based, a Python int of any size), in float64:
        every backend computes it on the host, so no int32 count bounds the schedule."""
        lr = self.lr
        if self.warmup:
            lr = lr * min(1.0, (t + 1) / self.warmup)
        if self.decay_steps > self.warmup:
            progress = min(max((t - self.warmup) / (self.decay_steps - self.warmup), 0.0), 1.0)
            lr = lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
        return lr


@dataclass
class AdamState:
    """AdamW's moments (global float32 arrays by parameter name) and the number of updates done."""

    mu: dict = field(default_factory=dict)
    nu: dict = field(default_factory=dict)
    count: int = 0


def clip_scale(norm: float, clip: float) -> float:
    """optax.clip_by_global_norm's factor: 1 below ``clip``, else clip / norm."""
    return 1.0 if norm < clip else clip / norm


def adamw_update(params: dict, grads: dict, state: AdamState, cfg: OptimizerConfig) -> dict:
    """One update, in numpy, as optax.chain(clip_by_global_norm, adamw) and torch's AdamW take it
    (the specification the numpy backend runs): the new parameters; ``state`` is advanced."""
    norm = math.sqrt(sum(float(np.sum(np.asarray(g, np.float64) ** 2)) for g in grads.values()))
    scale = np.float32(clip_scale(norm, cfg.clip))
    t = state.count + 1
    lr = np.float32(cfg.lr_at(state.count))
    out = {}
    for k, p in params.items():
        g = grads[k] * scale
        mu = state.mu.get(k, np.zeros_like(p))
        nu = state.nu.get(k, np.zeros_like(p))
        mu = np.float32(cfg.beta1) * mu + np.float32(1 - cfg.beta1) * g
        nu = np.float32(cfg.beta2) * nu + np.float32(1 - cfg.beta2) * g * g
        state.mu[k], state.nu[k] = mu, nu
        m_hat = mu / np.float32(1 - cfg.beta1 ** t)
        v_hat = nu / np.float32(1 - cfg.beta2 ** t)
        out[k] = (p - lr * (m_hat / (np.sqrt(v_hat) + np.float32(cfg.eps)) + np.float32(cfg.weight_decay) * p)
                  ).astype(np.float32)
    state.count = t
    return out
