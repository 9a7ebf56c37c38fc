"""Layers written once: parameter declarations and forwards against the neutral ``Ops``.

A layer declares its parameters (name, shape, logical dims, initializer) and writes its forward
against ``Ops``; it never names a mesh axis. Parameters are a flat dict from dotted names to
arrays, initialised in numpy from a seed, so every backend starts from the same bits.

The logical vocabulary (``Dim``) is declared once here. A model may use other names; a strategy's
rules refer to whichever names the model uses.
"""

from __future__ import annotations

import enum
import zlib
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from .ops import LogicalDims, Ops

__all__ = [
    "Dim", "Init", "ParamDecl", "init_params", "Embedding", "Linear", "RMSNorm", "LayerNorm", "Attention", "MLP",
    "Block", "Activation", "RESIDUAL", "PROJ_IN", "PROJ_HEADS", "ATTN", "ATTN_KV", "HIDDEN", "LOGITS",
]


class Dim(str, enum.Enum):
    """parlay's logical dim names (a ``str``: rules and layers may write the plain strings)."""

    BATCH = "batch"
    SEQ = "seq"  # the sequence in the residual stream (norms, dropout): Megatron SP and Ulysses shard it
    INPUT_SEQ = "input_seq"  # the sequence of the inputs (token ids, targets): whole under the built-in strategies
    PROJ_SEQ = "proj_seq"  # the sequence at the projections and in the MLP: Megatron SP gathers it
    ATTN_SEQ = "attn_seq"  # the sequence inside attention: whole under Ulysses, which shards heads
    EMBED = "embed"
    HEADS = "heads"
    KV_HEADS = "kv_heads"
    KV = "kv"  # head_dim (MaxText's name for it)
    MLP = "mlp"
    VOCAB = "vocab"
    LAYERS = "layers"

    def __str__(self) -> str:
        return self.value


class Init(enum.Enum):
    NORMAL = "normal"
    ZEROS = "zeros"
    ONES = "ones"


@dataclass(frozen=True, slots=True)
class ParamDecl:
    """A parameter: its dotted name, global shape, one logical name (or None) per dim, initializer."""

    name: str
    shape: tuple[int, ...]
    dims: tuple[str | None, ...]
    init: Init = Init.NORMAL
    std: float = 0.02

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"a parameter's name is a non-empty str, got {self.name!r}.")
        if len(self.shape) != len(self.dims):
            raise ValueError(f"param {self.name!r}: shape {self.shape} has {len(self.shape)} dims but "
                             f"{len(self.dims)} logical names {self.dims}.")
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))
        object.__setattr__(self, "dims", tuple(None if d is None else str(d) for d in self.dims))


def init_params(decls: Sequence[ParamDecl], seed: int) -> dict[str, np.ndarray]:
    """float32 arrays; each parameter's stream depends only on (seed, its name)."""
    out = {}
    for d in decls:
        if d.init is Init.ZEROS:
            out[d.name] = np.zeros(d.shape, np.float32)
        elif d.init is Init.ONES:
            out[d.name] = np.ones(d.shape, np.float32)
        else:
            rng = np.random.default_rng([seed, zlib.crc32(d.name.encode())])
            out[d.name] = (rng.standard_normal(d.shape) * d.std).astype(np.float32)
    return out


# Activation layouts at the GPT's constraint points (see ``Dim`` for the three sequence names).
RESIDUAL = ("batch", "seq", "embed")
PROJ_IN = ("batch", "proj_seq", "embed")
PROJ_HEADS = ("batch", "proj_seq", "heads", "kv")
ATTN = ("batch", "attn_seq", "heads", "kv")
ATTN_KV = ("batch", "attn_seq", "kv_heads", "kv")
HIDDEN = ("batch", "proj_seq", "mlp")
LOGITS = ("batch", "proj_seq", "vocab")


@dataclass(frozen=True)
class Embedding:
    vocab: int
    embed: int

    def decls(self, prefix: str) -> tuple[ParamDecl, ...]:
        return (ParamDecl(f"{prefix}.table", (self.vocab, self.embed), ("vocab", "embed")),)

    def __call__(self, ops: Ops, p: Mapping[str, Any], prefix: str, tokens):
        table = ops.param(f"{prefix}.table", p[f"{prefix}.table"], ("vocab", "embed"))
        return ops.embed(table, tokens)  # (B, S, E)


@dataclass(frozen=True)
class Linear:
    """``x @ w`` with named dims: ``in_dims`` are contracted, ``out_dims`` appended; ``lead``
    names x's leading dims with einsum letters (default ``"bs"``: batch and sequence)."""

    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    in_dims: tuple[str, ...]
    out_dims: tuple[str, ...]
    std: float = 0.02
    bias: bool = False

    def decls(self, prefix: str) -> tuple[ParamDecl, ...]:
        out = (ParamDecl(f"{prefix}.w", self.in_shape + self.out_shape, self.in_dims + self.out_dims, std=self.std),)
        if self.bias:
            out += (ParamDecl(f"{prefix}.b", self.out_shape, self.out_dims, Init.ZEROS),)
        return out

    def __call__(self, ops: Ops, p, prefix: str, x, *, lead: str = "bs"):
        letters = iter("ijklmnopqr")
        ins = "".join(next(letters) for _ in self.in_dims)
        outs = "".join(next(letters) for _ in self.out_dims)
        w = ops.param(f"{prefix}.w", p[f"{prefix}.w"], self.in_dims + self.out_dims)
        y = ops.einsum(f"{lead}{ins},{ins}{outs}->{lead}{outs}", x, w)
        if self.bias:
            y = ops.add_bias(y, ops.param(f"{prefix}.b", p[f"{prefix}.b"], self.out_dims))
        return y


@dataclass(frozen=True)
class RMSNorm:
    embed: int
    eps: float = 1e-5
    dim: str = "embed"

    def decls(self, prefix: str) -> tuple[ParamDecl, ...]:
        return (ParamDecl(f"{prefix}.scale", (self.embed,), (self.dim,), Init.ONES),)

    def __call__(self, ops: Ops, p, prefix: str, x):
        return ops.rms_norm(x, ops.param(f"{prefix}.scale", p[f"{prefix}.scale"], (self.dim,)), self.eps)


@dataclass(frozen=True)
class LayerNorm:
    embed: int
    eps: float = 1e-5
    dim: str = "embed"

    def decls(self, prefix: str) -> tuple[ParamDecl, ...]:
        return (ParamDecl(f"{prefix}.scale", (self.embed,), (self.dim,), Init.ONES),
                ParamDecl(f"{prefix}.bias", (self.embed,), (self.dim,), Init.ZEROS))

    def __call__(self, ops: Ops, p, prefix: str, x):
        scale = ops.param(f"{prefix}.scale", p[f"{prefix}.scale"], (self.dim,))
        bias = ops.param(f"{prefix}.bias", p[f"{prefix}.bias"], (self.dim,))
        return ops.layer_norm(x, scale, bias, self.eps)


class Activation(enum.Enum):
    GELU = "gelu"
    SWIGLU = "swiglu"


@dataclass(frozen=True)
class Attention:
    embed: int
    heads: int
    kv_heads: int
    head_dim: int
    out_std: float
    bias: bool = False
    causal: bool = True

    def decls(self, prefix: str) -> tuple[ParamDecl, ...]:
        E, H, K, D = self.embed, self.heads, self.kv_heads, self.head_dim
        out = (
            ParamDecl(f"{prefix}.wq", (E, H, D), ("embed", "heads", "kv")),
            ParamDecl(f"{prefix}.wk", (E, K, D), ("embed", "kv_heads", "kv")),
            ParamDecl(f"{prefix}.wv", (E, K, D), ("embed", "kv_heads", "kv")),
            ParamDecl(f"{prefix}.wo", (H, D, E), ("heads", "kv", "embed"), std=self.out_std),
        )
        if self.bias:
            out += (
                ParamDecl(f"{prefix}.bq", (H, D), ("heads", "kv"), Init.ZEROS),
                ParamDecl(f"{prefix}.bk", (K, D), ("kv_heads", "kv"), Init.ZEROS),
                ParamDecl(f"{prefix}.bv", (K, D), ("kv_heads", "kv"), Init.ZEROS),
                ParamDecl(f"{prefix}.bo", (E,), ("embed",), Init.ZEROS),
            )
        return out

    def __call__(self, ops: Ops, p, prefix: str, x, cos, sin):
        """``cos``/``sin``: rotary tables, or None (positions were added to the embeddings)."""
        w = lambda n, dims: ops.param(f"{prefix}.{n}", p[f"{prefix}.{n}"], dims)
        b = lambda y, n, dims: ops.add_bias(y, w(n, dims)) if self.bias else y
        x = ops.constrain(x, PROJ_IN)  # Megatron SP gathers the sequence here
        q = b(ops.einsum("bse,ehd->bshd", x, w("wq", ("embed", "heads", "kv"))), "bq", ("heads", "kv"))  # (B, S, H, D)
        k = b(ops.einsum("bse,ehd->bshd", x, w("wk", ("embed", "kv_heads", "kv"))), "bk", ("kv_heads", "kv"))  # (B, S, K, D)
        v = b(ops.einsum("bse,ehd->bshd", x, w("wv", ("embed", "kv_heads", "kv"))), "bv", ("kv_heads", "kv"))
        if cos is not None:
            q, k = ops.rotary(q, cos, sin), ops.rotary(k, cos, sin)
        q = ops.constrain(q, ATTN)
        k = ops.constrain(k, ATTN_KV)
        v = ops.constrain(v, ATTN_KV)
        o = ops.constrain(ops.attention(q, k, v, causal=self.causal), ATTN)  # (B, S, H, D)
        o = ops.constrain(o, PROJ_HEADS)  # Ulysses: all-to-all back to sequence shards
        y = ops.einsum("bshd,hde->bse", o, w("wo", ("heads", "kv", "embed")))  # (B, S, E), partial over heads
        return b(y, "bo", ("embed",))  # the bias joins one addend of the pending sum


@dataclass(frozen=True)
class MLP:
    embed: int
    hidden: int
    activation: Activation
    out_std: float
    bias: bool = False

    def decls(self, prefix: str) -> tuple[ParamDecl, ...]:
        E, F = self.embed, self.hidden
        out = [ParamDecl(f"{prefix}.w_in", (E, F), ("embed", "mlp"))]
        if self.activation is Activation.SWIGLU:
            out.append(ParamDecl(f"{prefix}.w_gate", (E, F), ("embed", "mlp")))
        out.append(ParamDecl(f"{prefix}.w_out", (F, E), ("mlp", "embed"), std=self.out_std))
        if self.bias:
            out.append(ParamDecl(f"{prefix}.b_in", (F,), ("mlp",), Init.ZEROS))
            if self.activation is Activation.SWIGLU:
                out.append(ParamDecl(f"{prefix}.b_gate", (F,), ("mlp",), Init.ZEROS))
            out.append(ParamDecl(f"{prefix}.b_out", (E,), ("embed",), Init.ZEROS))
        return tuple(out)

    def __call__(self, ops: Ops, p, prefix: str, x):
        w = lambda n, dims: ops.param(f"{prefix}.{n}", p[f"{prefix}.{n}"], dims)
        b = lambda y, n, dims: ops.add_bias(y, w(n, dims)) if self.bias else y
        x = ops.constrain(x, PROJ_IN)
        h = b(ops.einsum("bse,ef->bsf", x, w("w_in", ("embed", "mlp"))), "b_in", ("mlp",))  # (B, S, F)
        if self.activation is Activation.SWIGLU:
            gate = b(ops.einsum("bse,ef->bsf", x, w("w_gate", ("embed", "mlp"))), "b_gate", ("mlp",))
            h = ops.mul(ops.silu(gate), h)
        else:
            h = ops.gelu(h)
        h = ops.constrain(h, HIDDEN)
        y = ops.einsum("bsf,fe->bse", h, w("w_out", ("mlp", "embed")))  # (B, S, E), partial over mlp
        return b(y, "b_out", ("embed",))


@dataclass(frozen=True)
class Block:
    """Pre-norm transformer block: x + drop(attn(norm(x))), then + drop(mlp(norm(x))); ``residual``
    names the residual stream's dims at the constraint points after each branch; ``dropout`` is
    the rate on each branch's output (training only)."""

    norm1: RMSNorm | LayerNorm
    attn: Attention
    norm2: RMSNorm | LayerNorm
    mlp: MLP
    residual: LogicalDims = RESIDUAL
    dropout: float = 0.0

    def decls(self, prefix: str) -> tuple[ParamDecl, ...]:
        return (self.norm1.decls(f"{prefix}.norm1") + self.attn.decls(f"{prefix}.attn")
                + self.norm2.decls(f"{prefix}.norm2") + self.mlp.decls(f"{prefix}.mlp"))

    def __call__(self, ops: Ops, p, prefix: str, x, cos=None, sin=None):
        h = ops.constrain(self.attn(ops, p, f"{prefix}.attn", self.norm1(ops, p, f"{prefix}.norm1", x), cos, sin),
                          self.residual)
        if self.dropout:
            h = ops.dropout(h, self.dropout, key=f"{prefix}.attn")
        x = ops.add(x, h)
        h = ops.constrain(self.mlp(ops, p, f"{prefix}.mlp", self.norm2(ops, p, f"{prefix}.norm2", x)), self.residual)
        if self.dropout:
            h = ops.dropout(h, self.dropout, key=f"{prefix}.mlp")
        return ops.add(x, h)
