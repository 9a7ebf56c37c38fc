"""A Flax NNX model trained under parlay's strategies: a residual MLP classifier written as any NNX
user writes one, its parameters annotated with logical dim names (``nnx.with_partitioning``).

    parlay compare --model examples/nnx_mlp.py:model --strategy fsdp --mesh dp=4 --backends jax-gspmd
    parlay compare --model examples/nnx_mlp.py:model --strategy examples/nnx_mlp.py:FLAX_TP \\
        --mesh dp=2,tp=4 --backends jax-gspmd
    parlay train --model examples/nnx_mlp.py:model --strategy fsdp+tp --mesh dp=2,tp=2 --backend jax --mode gspmd \
        --steps 200 --warmup 20 --lr 3e-3

The names (``batch``, ``embed``, ``mlp``, ``classes``) are parlay's built-in strategies' vocabulary,
so ``dp``, ``fsdp``, ``tp`` and their sums place it as they place the GPT; ``FLAX_TP`` is a strategy
from a Flax rule list, the form Flax and MaxText users already have.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import math

from parlay import DType, InputDecl
from parlay.backends.jax.nnx import NnxModel, constrain, strategy_from_flax

FEATURES, WIDTH, HIDDEN, CLASSES, BLOCKS = 64, 64, 256, 10, 2  # scikit-learn's 8x8 digits, flattened
normal = nnx.initializers.normal(0.02)


class Block(nnx.Module):
    """x + W_out gelu(W_in norm(x)): the hidden activations are a constraint point."""

    def __init__(self, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(WIDTH, scale_init=nnx.with_partitioning(nnx.initializers.ones, ("embed",)),
                                  bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("embed",)), rngs=rngs)
        self.w_in = nnx.Linear(WIDTH, HIDDEN, kernel_init=nnx.with_partitioning(normal, ("embed", "mlp")),
                               bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("mlp",)), rngs=rngs)
        self.w_out = nnx.Linear(HIDDEN, WIDTH, kernel_init=nnx.with_partitioning(normal, ("mlp", "embed")),
                                bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("embed",)), rngs=rngs)

    def __call__(self, x):
        h = constrain(jax.nn.gelu(self.w_in(self.norm(x))), ("batch", "mlp"))
        return x + self.w_out(h)


class Classifier(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.stem = nnx.Linear(FEATURES, WIDTH, kernel_init=nnx.with_partitioning(normal, ("features", "embed")),
                               use_bias=False, rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(BLOCKS)])
        self.head = nnx.Linear(WIDTH, CLASSES, kernel_init=nnx.with_partitioning(normal, ("embed", "classes")),
                               use_bias=False, rngs=rngs)

    def __call__(self, x):
        x = constrain(self.stem(x), ("batch", "embed"))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def loss(module: Classifier, batch) -> jax.Array:
    logits = module(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def inputs(batch: int):
    return {"x": InputDecl((batch, FEATURES), ("batch", "features"), DType.FLOAT32),
            "y": InputDecl((batch,), ("batch",), DType.INT32, high=CLASSES)}


class Digits:
    """scikit-learn's 1,797 digits as 64 pixels in [0, 1], in a fixed shuffled order: 1,500 train, 297
    held out; step t's batch is a function of (seed, t) alone, so a resumed run reads what the
    uninterrupted one read."""

    source = "scikit-learn's handwritten digits"

    def __init__(self, files=()):
        from sklearn.datasets import load_digits

        if files:
            raise ValueError("the NNX classifier trains on scikit-learn's digits; it takes no --data files.")
        d = load_digits()
        order = np.random.default_rng(0).permutation(len(d.target))
        self.x = (d.data[order] / 16.0).astype(np.float32)
        self.y = d.target[order].astype(np.int32)

    def batch_at(self, step: int, batch: int, *, seed: int, split=None) -> dict:
        held_out = getattr(split, "value", split) == "held_out"
        lo, hi = (1500, len(self.y)) if held_out else (0, 1500)
        idx = np.random.default_rng([seed, step, not held_out]).integers(lo, hi, batch)
        return {"x": self.x[idx], "y": self.y[idx]}

    def baseline(self) -> tuple[str, float]:
        return "a uniform guess", math.log(CLASSES)


model = NnxModel(Classifier, loss, inputs, dataset=Digits)

# Tensor parallelism as a Flax/MaxText user writes it: one logical-axis rule list.
FLAX_TP = strategy_from_flax("flax_tp", [("batch", "dp"), ("mlp", "tp"), ("classes", None)])


def train_in_nnx(steps: int = 5, seed: int = 0) -> list[float]:
    """The same model in an ordinary NNX loop (optax, one device): what parlay's runs compare with."""
    with nnx.use_eager_sharding(False):
        module = Classifier(nnx.Rngs(seed))
    opt = nnx.Optimizer(module, optax.adamw(1e-3), wrt=nnx.Param)
    rng = np.random.default_rng(seed)
    losses = []
    for _ in range(steps):
        batch = {"x": jnp.asarray(rng.normal(size=(16, FEATURES)), jnp.float32),
                 "y": jnp.asarray(rng.integers(0, CLASSES, 16), jnp.int32)}
        value, grads = nnx.value_and_grad(loss)(module, batch)
        opt.update(module, grads)
        losses.append(float(value))
    return losses


if __name__ == "__main__":
    print(train_in_nnx())
