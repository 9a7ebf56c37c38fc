"""A GPT-style decoder built from the neutral layers, and its presets.

``GPT(config)`` meets the ``Model`` protocol: parameters ``decls()``, inputs ``tokens`` and
``targets`` (both (batch, seq) ints), ``loss(ops, params, batch)`` the mean next-token cross
entropy, and ``dataset(files)`` the byte-level text it trains on.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, fields, replace
from typing import Any, Mapping, Sequence

import numpy as np

from ..layers import (LOGITS, PROJ_IN, RESIDUAL, Activation, Attention, Block, Embedding, LayerNorm, Linear, MLP,
                      ParamDecl, RMSNorm, init_params)
from ..model import DType, InputDecl
from ..ops import LogicalDims, Ops

__all__ = ["Norm", "Positions", "GPTConfig", "PRESETS", "GPT", "rotary_tables", "config_json", "config_from_json"]


class Norm(enum.Enum):
    RMS = "rms"
    LAYER = "layer"


class Positions(enum.Enum):
    ROTARY = "rotary"  # rotary on q and k (LLaMA); pairs are the two halves of head_dim
    LEARNED = "learned"  # a learned (seq, embed) table added to the token embeddings (GPT-2)


TOKENS = ("batch", "input_seq")  # the (B, S) token ids: split like the batch, the sequence whole (no rule maps it)


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
    dropout: float = 0.0  # on each block's attention and MLP output (training steps only)

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
        if not (isinstance(self.dropout, (int, float)) and 0 <= self.dropout < 1):
            problems.append(f"dropout={self.dropout!r} must be a rate in [0, 1)")
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
    # tiny with 8 layers: room for pipeline stages (pp=4 with 2 virtual stages a rank, or pp=2 with 4)
    "tiny-deep": GPTConfig(vocab=256, seq=16, embed=64, heads=8, kv_heads=8, layers=8, mlp=128),
    "tiny-gpt2": GPTConfig(vocab=256, seq=16, embed=64, heads=8, kv_heads=8, layers=2, mlp=256,
                           norm=Norm.LAYER, activation=Activation.GELU),
    # GPT-2 as Hugging Face builds it: learned positions, biases, the LM head tied to the embedding.
    "tiny-gpt2-hf": GPTConfig(vocab=256, seq=16, embed=64, heads=8, kv_heads=8, layers=2, mlp=256,
                              norm=Norm.LAYER, activation=Activation.GELU, positions=Positions.LEARNED,
                              bias=True, tie_embeddings=True),
    # GPT-2 small's sizes with an untied LM head, the vocabulary padded to 50304 as nanoGPT does:
    # 162M parameters (124M with GPT-2's tied head and learned positions; tests/core/test_gpt.py).
    "gpt2-small": GPTConfig(vocab=50304, seq=1024, embed=768, heads=12, kv_heads=12, layers=12, mlp=3072,
                            norm=Norm.LAYER, activation=Activation.GELU),
}


def rotary_tables(seq: int, head_dim: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    inv = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.outer(np.arange(seq, dtype=np.float64), inv)  # (S, D/2)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def config_json(config: GPTConfig) -> dict:
    return {f.name: (v.value if isinstance(v, enum.Enum) else v) for f in fields(config)
            for v in [getattr(config, f.name)]}


def config_from_json(data: dict, where: str = "model config") -> GPTConfig:
    """A ``GPTConfig`` from ``config_json``'s dict (enums by value), every field checked."""
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be an object, not {data!r:.80}")
    known = {f.name: f for f in fields(GPTConfig)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r}; GPTConfig has {sorted(known)}")
    values = {}
    for name, value in data.items():
        default = getattr(GPTConfig(), name)
        if isinstance(default, enum.Enum):
            try:
                value = type(default)(value)
            except ValueError:
                raise ValueError(f"{where}: field {name!r} is {value!r}; one of "
                                 f"{[e.value for e in type(default)]}") from None
        values[name] = value
    return GPTConfig(**values)


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
                  MLP(c.embed, c.mlp, c.activation, out_std, c.bias), dropout=c.dropout)
            for _ in range(c.layers)
        )

    @property
    def final_norm(self):
        c = self.config
        return RMSNorm(c.embed, c.eps) if c.norm is Norm.RMS else LayerNorm(c.embed, c.eps)

    @property
    def lm_head(self) -> Linear:
        c = self.config
        return Linear((c.embed,), (c.vocab,), ("embed",), ("vocab",))

    # -- the Model protocol ---------------------------------------------------------------------
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

    def inputs(self, batch: int) -> dict[str, InputDecl]:
        c = self.config
        tokens = InputDecl((batch, c.seq), TOKENS, DType.INT32, high=c.vocab)
        return {"tokens": tokens, "targets": tokens}

    def loss(self, ops: Ops, params: Mapping[str, Any], batch: Mapping[str, Any]):
        """Mean next-token cross entropy of ``batch["tokens"]`` against ``batch["targets"]``."""
        return ops.cross_entropy(self.logits(ops, params, batch["tokens"]), batch["targets"])

    def init(self, seed: int = 0) -> dict[str, np.ndarray]:
        return init_params(self.decls(), seed)

    def dataset(self, files: Sequence[str] = ()):
        """Bytes of the Python standard library's source, or of ``files`` (vocabulary 256)."""
        from ..text import TextData

        if self.config.vocab < 256:
            raise ValueError(f"this GPT has vocab {self.config.vocab}; byte-level text needs 256.")
        return TextData(self.config.seq, files)

    def describe(self) -> dict:
        return {"kind": "gpt", "config": config_json(self.config)}

    # -- helpers ------------------------------------------------------------------------------------
    def param_dims(self) -> dict[str, LogicalDims]:
        return {d.name: d.dims for d in self.decls()}

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {d.name: d.shape for d in self.decls()}

    def logits(self, ops: Ops, params: Mapping[str, Any], tokens):
        """(B, S, V) next-token logits of (B, S) int tokens, S = config.seq."""
        x = self._embed(ops, params, tokens)
        for i in range(self.config.layers):
            x = self.layer(ops, params, i, x)
        return self._logits(ops, params, x)

    # -- pipeline stages (core.pipeline.PipelineModel): embed, the repeated layers, the head -----------
    def layers(self) -> int:
        return self.config.layers

    def residual(self, batch: int) -> tuple[tuple[int, ...], tuple]:
        """The value that passes between pipeline stages: the residual stream (B, S, E)."""
        return (batch, self.config.seq, self.config.embed), RESIDUAL

    def embed(self, ops: Ops, params: Mapping[str, Any], batch: Mapping[str, Any]):
        return self._embed(ops, params, batch["tokens"])

    def layer(self, ops: Ops, params: Mapping[str, Any], i: int, x):
        c = self.config
        cos = sin = None
        if c.positions is not Positions.LEARNED:
            cos, sin = (ops.constant(t) for t in rotary_tables(c.seq, c.head_dim, c.rope_base))
        return self.blocks[i](ops, params, f"blocks.{i}", x, cos, sin)

    def head(self, ops: Ops, params: Mapping[str, Any], x, batch: Mapping[str, Any]):
        return ops.cross_entropy(self._logits(ops, params, x), batch["targets"])

    def _embed(self, ops: Ops, params: Mapping[str, Any], tokens):
        c = self.config
        x = Embedding(c.vocab, c.embed)(ops, params, "embed", tokens)  # (B, S, E), partial over vocab's axes
        if c.positions is Positions.LEARNED:
            x = ops.add_bias(x, ops.param("pos_embed.table", params["pos_embed.table"], ("seq", "embed")))
        return ops.constrain(x, RESIDUAL)

    def _logits(self, ops: Ops, params: Mapping[str, Any], x):
        c = self.config
        x = ops.constrain(self.final_norm(ops, params, "final_norm", x), PROJ_IN)
        if c.tie_embeddings:  # the table's second use: its gradient is the sum of both
            table = ops.param("embed.table", params["embed.table"], ("vocab", "embed"))
            logits = ops.einsum("bse,ve->bsv", x, table)
        else:
            logits = self.lm_head(ops, params, "lm_head", x)
        return ops.constrain(logits, LOGITS)  # (B, S, V)
