"""The neutral ops interface: what a layer's forward may call. Each backend implements it.

Tensors are the backend's own (a jax.Array, a torch.Tensor, or a sharded wrapper); layers never
look inside them. Every op is named by what it computes on global arrays; a backend that holds
local shards turns each into local work plus the collectives its layouts need.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

__all__ = ["Ops", "LogicalDims"]

LogicalDims = Sequence[str | None]
Tensor = Any


class Ops(Protocol):
    def param(self, name: str, value: Tensor, dims: LogicalDims) -> Tensor:
        """A parameter in the layout it is used in (FSDP gathers it here; its transpose is the
        gradient's reduce-scatter)."""

    def constrain(self, x: Tensor, dims: LogicalDims) -> Tensor:
        """Put an activation in the layout its logical dims resolve to (a constraint point)."""

    def einsum(self, equation: str, *operands: Tensor) -> Tensor: ...

    def add(self, x: Tensor, y: Tensor) -> Tensor: ...

    def mul(self, x: Tensor, y: Tensor) -> Tensor: ...

    def add_bias(self, x: Tensor, b: Tensor) -> Tensor:
        """``x + b`` where b's dims are x's trailing dims (a (D,) bias, a (H, D) bias, the (S, E)
        learned position table). A pending sum gets the bias once, not once per addend."""

    def gelu(self, x: Tensor) -> Tensor:
        """GELU, tanh approximation (GPT-2's)."""

    def silu(self, x: Tensor) -> Tensor: ...

    def rms_norm(self, x: Tensor, scale: Tensor, eps: float) -> Tensor:
        """Over the last dim."""

    def layer_norm(self, x: Tensor, scale: Tensor, bias: Tensor, eps: float) -> Tensor:
        """Over the last dim."""

    def embed(self, table: Tensor, tokens: Tensor) -> Tensor:
        """``table[tokens]``: (V, E) and (B, S) ints -> (B, S, E)."""

    def rotary(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Rotary positions on (B, S, H, D) with (S, D/2) tables (pairs are the two halves of D)."""

    def attention(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True) -> Tensor:
        """Softmax attention on (B, S, H, D); k and v may have fewer heads (grouped-query), a
        divisor of q's, each serving H/Hkv consecutive query heads."""

    def cross_entropy(self, logits: Tensor, targets: Tensor) -> Tensor:
        """Mean over all tokens of -log softmax(logits)[target]; logits (B, S, V), targets (B, S)."""

    def constant(self, value: Any) -> Tensor:
        """A numpy array (e.g. rotary tables) as a replicated backend tensor."""
