"""A model that is not a GPT: a small ViT-style encoder that classifies scikit-learn's handwritten
digits (8 x 8 images, 10 classes, shipped inside the package: nothing is downloaded).

It meets parlay's Model protocol with its own logical dims and brings its own strategies:

    parlay compare --model examples/vit.py:model --strategy examples/vit.py:DATA+examples/vit.py:TP --mesh dp=2,tp=2
    parlay train   --model examples/vit.py:model --strategy examples/vit.py:FSDP --mesh dp=4 --backend jax

Images are cut into 2 x 2 patches with ``rearrange``; each block is pre-norm self-attention
(written with einsums and ``softmax``: bidirectional, no mask) and a GELU MLP; the encoder
mean-pools the patches and a linear head gives the class logits; the loss is the cross entropy
against (B,) labels.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from parlay import Rules
from parlay.core.layers import Init, ParamDecl, init_params
from parlay.core.model import DType, InputDecl, Split
from parlay.core.strategies import Strategy

__all__ = ["ViTConfig", "ViT", "Digits", "model", "DATA", "FSDP", "TP", "PATCHES"]

# The model's logical dims (its own names: no GPT vocabulary).
IMAGES, PATCHES_, FEATURES, HEADS, HEAD_DIM, HIDDEN, CLASSES = (
    "images", "patches", "features", "heads", "head_dim", "hidden", "classes")
TOKENS = (IMAGES, PATCHES_, FEATURES)


@dataclass(frozen=True)
class ViTConfig:
    image: int = 8
    patch: int = 2
    features: int = 32
    heads: int = 4
    hidden: int = 64
    layers: int = 2
    classes: int = 10
    eps: float = 1e-5

    @property
    def patches(self) -> int:
        return (self.image // self.patch) ** 2

    @property
    def head_dim(self) -> int:
        return self.features // self.heads


@dataclass(frozen=True)
class ViT:
    config: ViTConfig = ViTConfig()

    def decls(self) -> tuple[ParamDecl, ...]:
        c = self.config
        E, H, D, F, N = c.features, c.heads, c.head_dim, c.hidden, c.patches
        out = (ParamDecl("patch.w", (c.patch * c.patch, E), (None, FEATURES)),
               ParamDecl("pos.table", (N, E), (PATCHES_, FEATURES)))
        for i in range(c.layers):
            p = f"blocks.{i}"
            out += (ParamDecl(f"{p}.norm1.scale", (E,), (FEATURES,), Init.ONES),
                    ParamDecl(f"{p}.norm1.bias", (E,), (FEATURES,), Init.ZEROS),
                    *(ParamDecl(f"{p}.{n}", (E, H, D), (FEATURES, HEADS, HEAD_DIM)) for n in ("wq", "wk", "wv")),
                    ParamDecl(f"{p}.wo", (H, D, E), (HEADS, HEAD_DIM, FEATURES), std=0.02 / math.sqrt(2 * c.layers)),
                    ParamDecl(f"{p}.norm2.scale", (E,), (FEATURES,), Init.ONES),
                    ParamDecl(f"{p}.norm2.bias", (E,), (FEATURES,), Init.ZEROS),
                    ParamDecl(f"{p}.w_in", (E, F), (FEATURES, HIDDEN)),
                    ParamDecl(f"{p}.w_out", (F, E), (HIDDEN, FEATURES), std=0.02 / math.sqrt(2 * c.layers)))
        return out + (ParamDecl("norm.scale", (E,), (FEATURES,), Init.ONES),
                      ParamDecl("norm.bias", (E,), (FEATURES,), Init.ZEROS),
                      ParamDecl("head.w", (E, c.classes), (FEATURES, CLASSES)))

    def inputs(self, batch: int) -> dict[str, InputDecl]:
        c = self.config
        return {"images": InputDecl((batch, c.image, c.image), (IMAGES, None, None), DType.FLOAT32),
                "labels": InputDecl((batch,), (IMAGES,), DType.INT32, high=c.classes)}

    def loss(self, ops, params, batch):
        return ops.cross_entropy(self.logits(ops, params, batch["images"]), batch["labels"])

    def init(self, seed: int = 0) -> dict[str, np.ndarray]:
        return init_params(self.decls(), seed)

    def dataset(self, files=()):
        if files:
            raise ValueError("the digits model trains on scikit-learn's digits; it takes no --data files.")
        return Digits()

    def describe(self) -> dict:
        return {"kind": "vit", "config": asdict(self.config)}

    # -- the forward -------------------------------------------------------------------------------
    def logits(self, ops, params, images):
        c = self.config
        w = lambda name, dims: ops.param(name, params[name], dims)
        x = ops.rearrange(images, "b (h p) (w q) -> b (h w) (p q)", p=c.patch, q=c.patch)  # (B, N, P*P)
        x = ops.einsum("bnp,pe->bne", x, w("patch.w", (None, FEATURES)))  # (B, N, E)
        x = ops.constrain(ops.add_bias(x, w("pos.table", (PATCHES_, FEATURES))), TOKENS)
        for i in range(c.layers):
            x = self._block(ops, w, f"blocks.{i}", x)
        pooled = ops.mean(x, 1)  # (B, E): a pending sum where the patches are sharded
        pooled = ops.layer_norm(pooled, w("norm.scale", (FEATURES,)), w("norm.bias", (FEATURES,)), c.eps)
        return ops.constrain(ops.einsum("be,ec->bc", pooled, w("head.w", (FEATURES, CLASSES))), (IMAGES, CLASSES))

    def _block(self, ops, w, p, x):
        c = self.config
        h = ops.layer_norm(x, w(f"{p}.norm1.scale", (FEATURES,)), w(f"{p}.norm1.bias", (FEATURES,)), c.eps)
        q, k, v = (ops.constrain(ops.einsum("bne,ehd->bnhd", h, w(f"{p}.{n}", (FEATURES, HEADS, HEAD_DIM))),
                                 (IMAGES, PATCHES_, HEADS, HEAD_DIM)) for n in ("wq", "wk", "wv"))  # (B, N, H, D)
        scores = ops.scale(ops.einsum("bqhd,bkhd->bhqk", q, k), 1 / math.sqrt(c.head_dim))  # (B, H, N, N)
        att = ops.einsum("bhqk,bkhd->bqhd", ops.softmax(scores, -1), v)  # (B, N, H, D)
        y = ops.einsum("bqhd,hde->bqe", att, w(f"{p}.wo", (HEADS, HEAD_DIM, FEATURES)))  # partial over heads' axes
        x = ops.add(x, ops.constrain(y, TOKENS))
        h = ops.layer_norm(x, w(f"{p}.norm2.scale", (FEATURES,)), w(f"{p}.norm2.bias", (FEATURES,)), c.eps)
        h = ops.constrain(ops.gelu(ops.einsum("bne,ef->bnf", h, w(f"{p}.w_in", (FEATURES, HIDDEN)))),
                          (IMAGES, PATCHES_, HIDDEN))
        y = ops.einsum("bnf,fe->bne", h, w(f"{p}.w_out", (HIDDEN, FEATURES)))
        return ops.add(x, ops.constrain(y, TOKENS))


class Digits:
    """scikit-learn's 1,797 digits (pixels 0..16 scaled to [0, 1]), in a fixed shuffled order: the
    first 1,500 train, the other 297 are held out. Step t's batch is drawn from (seed, t)."""

    source = "scikit-learn's handwritten digits"

    def __init__(self):
        from sklearn.datasets import load_digits

        d = load_digits()
        order = np.random.default_rng(0).permutation(len(d.target))
        self.images = (d.images[order] / 16.0).astype(np.float32)
        self.labels = d.target[order].astype(np.int32)

    def batch_at(self, step: int, batch: int, *, seed: int, split=Split.TRAIN) -> dict[str, np.ndarray]:
        held_out = getattr(split, "value", split) == "held_out"
        lo, hi = (1500, len(self.labels)) if held_out else (0, 1500)
        idx = np.random.default_rng([seed, step, not held_out]).integers(lo, hi, batch)
        return {"images": self.images[idx], "labels": self.labels[idx]}

    def describe(self) -> str:
        return f"{self.source} (1,500 train / {len(self.labels) - 1500} held-out images)"

    def baseline(self) -> tuple[str, float]:
        return "a uniform guess", math.log(10)


def model() -> ViT:
    return ViT()


# Strategies over the model's own dims, on mesh axes dp, tp and sp; combine with '+' (DATA+TP).
DATA = Strategy("data", activations=Rules([(IMAGES, "dp")]))
FSDP = Strategy("fsdp", params=Rules([(FEATURES, "dp")]), compute=Rules(), activations=Rules([(IMAGES, "dp")]))
TP = Strategy("tp", params=Rules([(HEADS, "tp"), (HIDDEN, "tp")]), activations=Rules([(HEADS, "tp"), (HIDDEN, "tp")]))
PATCHES = Strategy("patches", activations=Rules([(PATCHES_, "sp")]))  # sequence parallel: patches over sp
