"""Layers written once, and a GPT-style decoder built from them.

A layer declares its parameters (name, shape, logical dims, initializer) and writes its forward
against the neutral ``Ops``; it never names a mesh axis. Parameters are a flat dict from dotted
names to arrays, initialised in numpy from a seed, so every backend starts from the same bits.
"""

from __future__ import annotations

import enum
import math
import zlib
from dataclasses import dataclass, fields, replace
from typing import Any, Mapping

import numpy as np

from .ops import LogicalDims, Ops

__all__ = [
    "Init", "ParamDecl", "Norm", "Activation", "Positions", "GPTConfig", "PRESETS", "GPT",
    "Embedding", "Linear", "RMSNorm", "LayerNorm", "Attention", "MLP", "Block",
    "init_params", "rotary_tables",
]


class Init(enum.Enum):
    NORMAL = "normal"
    ZEROS = "zeros"
    ONES = "ones"


@dataclass(frozen=True, slots=True)
class ParamDecl:
    name: str
    shape: tuple[int, ...]
    dims: tuple[str | None, ...]
    init: Init = Init.NORMAL
    std: float = 0.02

    def __post_init__(self):
        if len(self.shape) != len(self.dims):
            raise ValueError(f"param {self.name!r}: shape {self.shape} has {len(self.shape)} dims but "
                             f"{len(self.dims)} logical names {self.dims}.")


def init_params(decls: tuple[ParamDecl, ...], seed: int) -> dict[str, np.ndarray]:
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


# -- layers ---------------------------------------------------------------------------------------

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
    """``x @ w`` with named dims: ``in_dims`` are contracted, ``out_dims`` appended."""

    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    in_dims: tuple[str, ...]
    out_dims: tuple[str, ...]
    std: float = 0.02

    def decls(self, prefix: str) -> tuple[ParamDecl, ...]:
        return (ParamDecl(f"{prefix}.w", self.in_shape + self.out_shape, self.in_dims + self.out_dims, std=self.std),)

    def __call__(self, ops: Ops, p, prefix: str, x, *, lead: str = "bs"):
        letters = iter("ijklmnopqr")
        ins = "".join(next(letters) for _ in self.in_dims)
        outs = "".join(next(letters) for _ in self.out_dims)
        w = ops.param(f"{prefix}.w", p[f"{prefix}.w"], self.in_dims + self.out_dims)
        return ops.einsum(f"{lead}{ins},{ins}{outs}->{lead}{outs}", x, w)


@dataclass(frozen=True)
class RMSNorm:
    embed: int
    eps: float = 1e-5

    def decls(self, prefix: str) -> tuple[ParamDecl, ...]:
        return (ParamDecl(f"{prefix}.scale", (self.embed,), ("embed",), Init.ONES),)

    def __call__(self, ops: Ops, p, prefix: str, x):
        return ops.rms_norm(x, ops.param(f"{prefix}.scale", p[f"{prefix}.scale"], ("embed",)), self.eps)


@dataclass(frozen=True)
class LayerNorm:
    embed: int
    eps: float = 1e-5

    def decls(self, prefix: str) -> tuple[ParamDecl, ...]:
        return (ParamDecl(f"{prefix}.scale", (self.embed,), ("embed",), Init.ONES),
                ParamDecl(f"{prefix}.bias", (self.embed,), ("embed",), Init.ZEROS))

    def __call__(self, ops: Ops, p, prefix: str, x):
        scale = ops.param(f"{prefix}.scale", p[f"{prefix}.scale"], ("embed",))
        bias = ops.param(f"{prefix}.bias", p[f"{prefix}.bias"], ("embed",))
        return ops.layer_norm(x, scale, bias, self.eps)


class Norm(enum.Enum):
    RMS = "rms"
    LAYER = "layer"


class Activation(enum.Enum):
    GELU = "gelu"
    SWIGLU = "swiglu"


class Positions(enum.Enum):
    ROTARY = "rotary"  # rotary on q and k (LLaMA); pairs are the two halves of head_dim
    LEARNED = "learned"  # a learned (seq, embed) table added to the token embeddings (GPT-2)


# Activation layouts at the constraint points. The sequence dim has three names, so a strategy
# can shard it in one region and not another: ``seq`` in the residual stream (norms; Megatron SP
# and Ulysses shard it), ``proj_seq`` at the projections and in the MLP (Megatron SP gathers it,
# Ulysses keeps it sharded), ``attn_seq`` inside attention (never sharded: Ulysses shards heads).
RESIDUAL = ("batch", "seq", "embed")
PROJ_IN = ("batch", "proj_seq", "embed")
PROJ_HEADS = ("batch", "proj_seq", "heads", "kv")
ATTN = ("batch", "attn_seq", "heads", "kv")
ATTN_KV = ("batch", "attn_seq", "kv_heads", "kv")
HIDDEN = ("batch", "proj_seq", "mlp")
LOGITS = ("batch", "proj_seq", "vocab")
TOKENS = ("batch", None)


@dataclass(frozen=True)
class Attention:
    embed: int
    heads: int
    kv_heads: int
    head_dim: int
    out_std: float
    bias: bool = False

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
        o = ops.constrain(ops.attention(q, k, v, causal=True), ATTN)  # (B, S, H, D)
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
    """Pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(x))."""

    norm1: RMSNorm | LayerNorm
    attn: Attention
    norm2: RMSNorm | LayerNorm
    mlp: MLP

    def decls(self, prefix: str) -> tuple[ParamDecl, ...]:
        return (self.norm1.decls(f"{prefix}.norm1") + self.attn.decls(f"{prefix}.attn")
                + self.norm2.decls(f"{prefix}.norm2") + self.mlp.decls(f"{prefix}.mlp"))

    def __call__(self, ops: Ops, p, prefix: str, x, cos, sin):
        h = self.attn(ops, p, f"{prefix}.attn", self.norm1(ops, p, f"{prefix}.norm1", x), cos, sin)
        x = ops.add(x, ops.constrain(h, RESIDUAL))
        h = self.mlp(ops, p, f"{prefix}.mlp", self.norm2(ops, p, f"{prefix}.norm2", x))
        return ops.add(x, ops.constrain(h, RESIDUAL))


# -- the model -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256
    seq: int = 32
    embed: int = 64
    heads: int = 4
    kv_heads: int = 4
    layers: int = 2
    mlp: int = 256
    norm: Norm = Norm.RMS
    activation: Activation = Activation.SWIGLU
    eps: float = 1e-5
    rope_base: float = 10000.0
    positions: Positions = Positions.ROTARY
    bias: bool = False  # biases on q, k, v, the attention output and the MLP's projections
    tie_embeddings: bool = False  # the LM head is the embedding table (no lm_head parameter)

    def __post_init__(self):
        problems = []
        for f in ("vocab", "seq", "embed", "heads", "kv_heads", "layers", "mlp"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                problems.append(f"{f}={v!r} must be a positive int")
        for f, kind in (("norm", Norm), ("activation", Activation), ("positions", Positions)):
            if not isinstance(getattr(self, f), kind):
                problems.append(f"{f}={getattr(self, f)!r} must be a {kind.__name__} "
                                f"({', '.join(f'{kind.__name__}.{m.name}' for m in kind)})")
        for f in ("bias", "tie_embeddings"):
            if not isinstance(getattr(self, f), bool):
                problems.append(f"{f}={getattr(self, f)!r} must be a bool")
        if not problems:
            if self.embed % self.heads:
                problems.append(f"embed={self.embed} is not divisible by heads={self.heads} (head_dim = embed / heads)")
            elif self.head_dim % 2 and self.positions is Positions.ROTARY:
                problems.append(f"head_dim={self.head_dim} (embed / heads) must be even for rotary positions")
            if self.heads % self.kv_heads:
                problems.append(f"heads={self.heads} is not divisible by kv_heads={self.kv_heads} (grouped-query "
                                f"attention shares each kv head among heads / kv_heads query heads)")
        if problems:
            raise ValueError("GPTConfig: " + "; ".join(problems) + ".")

    @property
    def head_dim(self) -> int:
        return self.embed // self.heads

    def with_(self, **changes) -> "GPTConfig":
        names = {f.name for f in fields(self)}
        bad = [k for k in changes if k not in names]
        if bad:
            raise ValueError(f"GPTConfig has no field {bad[0]!r}; fields are {sorted(names)}.")
        return replace(self, **changes)


PRESETS: dict[str, GPTConfig] = {
    # For tests: every dim divisible by 8, so every strategy fits meshes of up to 8 devices.
    "tiny": GPTConfig(vocab=256, seq=16, embed=64, heads=8, kv_heads=8, layers=2, mlp=128),
    "tiny-gqa": GPTConfig(vocab=256, seq=16, embed=64, heads=8, kv_heads=4, layers=2, mlp=128),
    "tiny-gpt2": GPTConfig(vocab=256, seq=16, embed=64, heads=8, kv_heads=8, layers=2, mlp=256,
                           norm=Norm.LAYER, activation=Activation.GELU),
    # GPT-2 as Hugging Face builds it: learned positions, biases, the LM head tied to the embedding.
    "tiny-gpt2-hf": GPTConfig(vocab=256, seq=16, embed=64, heads=8, kv_heads=8, layers=2, mlp=256,
                              norm=Norm.LAYER, activation=Activation.GELU, positions=Positions.LEARNED,
                              bias=True, tie_embeddings=True),
    # GPT-2 small's sizes (124M with a 50257 vocab; padded to 50304 as nanoGPT does).
    "gpt2-small": GPTConfig(vocab=50304, seq=1024, embed=768, heads=12, kv_heads=12, layers=12, mlp=3072,
                            norm=Norm.LAYER, activation=Activation.GELU),
}


def rotary_tables(seq: int, head_dim: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    inv = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.outer(np.arange(seq, dtype=np.float64), inv)  # (S, D/2)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


@dataclass(frozen=True)
class GPT:
    config: GPTConfig

    @property
    def blocks(self) -> tuple[Block, ...]:
        c = self.config
        norm = (lambda: RMSNorm(c.embed, c.eps)) if c.norm is Norm.RMS else (lambda: LayerNorm(c.embed, c.eps))
        out_std = 0.02 / math.sqrt(2 * c.layers)
        return tuple(
            Block(norm(), Attention(c.embed, c.heads, c.kv_heads, c.head_dim, out_std, c.bias), norm(),
                  MLP(c.embed, c.mlp, c.activation, out_std, c.bias))
            for _ in range(c.layers)
        )

    @property
    def final_norm(self):
        c = self.config
        return RMSNorm(c.embed, c.eps) if c.norm is Norm.RMS else LayerNorm(c.embed, c.eps)

    def decls(self) -> tuple[ParamDecl, ...]:
        c = self.config
        out = Embedding(c.vocab, c.embed).decls("embed")
        if c.positions is Positions.LEARNED:
            out += (ParamDecl("pos_embed.table", (c.seq, c.embed), ("seq", "embed")),)
        for i, block in enumerate(self.blocks):
            out += block.decls(f"blocks.{i}")
        out += self.final_norm.decls("final_norm")
        if not c.tie_embeddings:
            out += self.lm_head.decls("lm_head")
        return out

    @property
    def lm_head(self) -> Linear:
        c = self.config
        return Linear((c.embed,), (c.vocab,), ("embed",), ("vocab",))

    def init(self, seed: int = 0) -> dict[str, np.ndarray]:
        return init_params(self.decls(), seed)

    def param_dims(self) -> dict[str, LogicalDims]:
        return {d.name: d.dims for d in self.decls()}

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {d.name: d.shape for d in self.decls()}

    def logits(self, ops: Ops, params: Mapping[str, Any], tokens):
        """(B, S, V) next-token logits of (B, S) int tokens, S = config.seq."""
        c = self.config
        x = Embedding(c.vocab, c.embed)(ops, params, "embed", tokens)  # (B, S, E), partial over vocab's axes
        cos = sin = None
        if c.positions is Positions.LEARNED:
            x = ops.add_bias(x, ops.param("pos_embed.table", params["pos_embed.table"], ("seq", "embed")))
        else:
            cos, sin = (ops.constant(t) for t in rotary_tables(c.seq, c.head_dim, c.rope_base))
        x = ops.constrain(x, RESIDUAL)
        for i, block in enumerate(self.blocks):
            x = block(ops, params, f"blocks.{i}", x, cos, sin)
        x = ops.constrain(self.final_norm(ops, params, "final_norm", x), PROJ_IN)
        if c.tie_embeddings:  # the table's second use: its gradient is the sum of both
            table = ops.param("embed.table", params["embed.table"], ("vocab", "embed"))
            logits = ops.einsum("bse,ve->bsv", x, table)
        else:
            logits = self.lm_head(ops, params, "lm_head", x)
        return ops.constrain(logits, LOGITS)  # (B, S, V)

    def loss(self, ops: Ops, params: Mapping[str, Any], tokens, targets):
        """Mean next-token cross entropy; tokens and targets are (B, S) ints."""
        return ops.cross_entropy(self.logits(ops, params, tokens), targets)
