"""Parameters and gradient tolerances for the cross-backend tests (imported by name: conftest
puts tests/ on sys.path, and spawned ranks inherit it)."""

import numpy as np

from parlay.core.layers import Init
from parlay.core.models.gpt import GPT


def params_for(model: GPT, seed: int = 0) -> dict[str, np.ndarray]:
    """``model.init(seed)``; for a model with biases, every parameter initialised to a constant
    (biases, norm scales and shifts) also gets noise, so a bias added on too many ranks, or a
    scale applied on the wrong shard, changes the result."""
    params = model.init(seed)
    if not model.config.bias:
        return params
    rng = np.random.default_rng(seed + 1)
    for d in model.decls():
        if d.init is not Init.NORMAL:
            params[d.name] = (params[d.name] + 0.02 * rng.standard_normal(d.shape)).astype(np.float32)
    return params


def grad_atol(name: str, g0: np.ndarray, grads0: dict[str, np.ndarray]) -> float:
    """1e-5 of the tensor's largest gradient element. The key bias (``attn.bk``) has a gradient
    of exactly zero (it shifts every score of a query by the same q.bk, which softmax ignores):
    what is computed is rounding noise, bounded by 1e-7 of the model's largest gradient element
    (measured: at most 7e-10 of it, on both backends)."""
    if name.endswith("attn.bk"):
        return 1e-7 * max(float(np.abs(g).max()) for g in grads0.values())
    return 1e-5 * float(np.abs(g0).max())
