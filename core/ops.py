"""The neutral ops: what a layer's forward may call (``Ops``), and what a backend's array library
must provide for them on whole arrays or one rank's blocks (``LocalOps``).

Tensors are the backend's own (a jax.Array, a torch.Tensor, a numpy autodiff value, or the
sharded executor's ``Sharded``); layers never look inside them except for ``.shape``. Every op is
named by what it computes on global arrays. ``DenseOps`` runs them on whole arrays (one device,
or GSPMD's global arrays, with hooks at the constraint points); ``parlay.core.executor`` runs them
on per-rank blocks with the collectives their layouts need.

Adding an op: a method here (``Ops``), a layout rule in ``core/layouts.py`` and a method in the
executor (or, for an elementwise op, a name in ``ELEMENTWISE``), and one local function per
backend (``LocalOps``: numpy, torch, JAX). The README's "Adding an op" walks through one.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

import numpy as np

__all__ = ["Ops", "LocalOps", "LogicalDims", "DenseOps", "ELEMENTWISE", "dropout_keep", "DropoutKey", "step_words",
           "vocab_cross_entropy"]

LogicalDims = Sequence[str | None]
Tensor = Any

# Elementwise ops of one operand: the executor completes pending sums and applies them blockwise.
ELEMENTWISE = ("gelu", "silu", "relu", "tanh")


class Ops(Protocol):
    def param(self, name: str, value: Tensor, dims: LogicalDims) -> Tensor:
        """A parameter in the layout it is used in (FSDP gathers it here; its transpose is the
        gradient's reduce-scatter)."""

    def constrain(self, x: Tensor, dims: LogicalDims) -> Tensor:
        """Put an activation in the layout its logical dims resolve to (a constraint point)."""

    def constant(self, value: Any) -> Tensor:
        """A numpy array (e.g. rotary tables) as a replicated tensor without gradient."""

    def einsum(self, equation: str, *operands: Tensor) -> Tensor: ...

    def add(self, x: Tensor, y: Tensor) -> Tensor:
        """Elementwise, equal shapes."""

    def mul(self, x: Tensor, y: Tensor) -> Tensor:
        """Elementwise, equal shapes."""

    def add_bias(self, x: Tensor, b: Tensor) -> Tensor:
        """``x + b`` where b's dims are x's trailing dims (a (D,) bias, a (H, D) bias, a (S, E)
        position table). A pending sum gets the bias once, not once per addend."""

    def scale(self, x: Tensor, c: float) -> Tensor:
        """``x * c`` for a Python number ``c`` (linear: pending sums stay pending)."""

    def gelu(self, x: Tensor) -> Tensor:
        """GELU, tanh approximation (GPT-2's)."""

    def silu(self, x: Tensor) -> Tensor: ...

    def relu(self, x: Tensor) -> Tensor: ...

    def tanh(self, x: Tensor) -> Tensor: ...

    def softmax(self, x: Tensor, dim: int = -1) -> Tensor: ...

    def sum(self, x: Tensor, dim: int) -> Tensor:
        """Sum over ``dim`` (removed). Over a sharded dim the result is a pending sum: no
        communication until a value needs it whole."""

    def mean(self, x: Tensor, dim: int) -> Tensor:
        """Mean over ``dim`` (removed); as ``sum``."""

    def rms_norm(self, x: Tensor, scale: Tensor, eps: float) -> Tensor:
        """Over the last dim."""

    def layer_norm(self, x: Tensor, scale: Tensor, bias: Tensor, eps: float) -> Tensor:
        """Over the last dim."""

    def embed(self, table: Tensor, tokens: Tensor) -> Tensor:
        """``table[tokens]``: (V, E) and int ids of any shape -> ids.shape + (E,)."""

    def rotary(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Rotary positions on (B, S, H, D) with (S, D/2) tables (pairs are the two halves of D)."""

    def attention(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True) -> Tensor:
        """Softmax attention on (B, S, H, D); k and v may have fewer heads (grouped-query), a
        divisor of q's, each serving H/Hkv consecutive query heads."""

    def dropout(self, x: Tensor, rate: float, *, key: str) -> Tensor:
        """In training steps, zero each element with probability ``rate`` and scale the rest by
        1/(1-rate); identity in evaluation. The bits are a function of (seed, step, key, the
        element's global index) alone: the same on every backend and every layout."""

    def rearrange(self, x: Tensor, pattern: str, **sizes: int) -> Tensor:
        """einops' ``rearrange`` (reshape and transpose by pattern, e.g. ``"b (h w) c -> b h w c"``)."""

    def cross_entropy(self, logits: Tensor, targets: Tensor) -> Tensor:
        """Mean over every leading position of -log softmax(logits)[target]; logits (..., V),
        int targets (...)."""


class LocalOps(Protocol):
    """A backend's math on plain arrays: whole arrays (one device) or one rank's blocks. Besides
    these methods the executor uses the arrays' own operators (+ - * / comparisons & ~)."""

    # -- the ops on whole (or local) arrays
    def einsum(self, equation: str, *xs): ...
    def gelu(self, x): ...
    def silu(self, x): ...
    def relu(self, x): ...
    def tanh(self, x): ...
    def softmax(self, x, dim: int): ...
    def rms_norm(self, x, scale, eps: float): ...
    def layer_norm(self, x, scale, bias, eps: float): ...
    def rotary(self, x, cos, sin): ...
    def attention(self, q, k, v, *, causal: bool): ...
    def rearrange(self, x, pattern: str, sizes: dict): ...
    def cross_entropy(self, logits, targets): ...

    # -- pieces the executor composes sharded reductions from
    def constant(self, value: np.ndarray): ...
    def sum(self, x, dim: int, *, keepdim: bool = False): ...
    def max(self, x, dim: int, *, keepdim: bool = False):
        """Without gradient (a shift that cancels)."""
    def exp(self, x): ...
    def log(self, x): ...
    def rsqrt(self, x): ...
    def take(self, table, ids):
        """Rows of a (V, E) table: ``table[ids]``."""
    def take_last(self, x, ids):
        """``x[..., ids[...]]``: one element of the last dim per leading position."""
    def where(self, mask, x, y): ...
    def concat(self, xs, dim: int): ...
    def barrier(self, xs):
        """``xs`` (a tuple), computed before anything that uses the result: keeps an unrolled
        loop's steps in order under a compiler (JAX: ``optimization_barrier``); eager backends
        return ``xs``."""
    def cast(self, x, like):
        """``x`` (bool or int) as ``like``'s float dtype."""
    def astype(self, x, dtype: str):
        """A floating ``x`` in the float dtype named ``dtype`` (``"bfloat16"``, ``"float32"``, ...),
        differentiably (the gradient comes back in x's dtype); any other ``x`` as it is. Mixed
        precision's casts (core/precision.py); the norms, softmax and the loss widen to float32
        inside themselves and hand back their input's dtype (the loss: float32)."""
    def iota(self, shape: tuple[int, ...], dim: int):
        """int32 indices along ``dim``, broadcastable to ``shape``."""
    def vocab_cross_entropy(self, logits, ids, hit, combine: Callable):
        """Per-position loss of (..., V/n) logits whose target column is ``ids`` (local, clamped)
        where ``hit``; ``combine(m, se, picked)`` sums the statistics over the vocabulary's
        shards (max, sum of exp(l - max), the target's logit) and returns them whole."""


def vocab_cross_entropy(local: LocalOps, logits, ids, hit, combine: Callable):
    """``LocalOps.vocab_cross_entropy`` from the other local ops: the shard's max (a shift, no
    gradient), sum of exponentials and target logit, combined over the shards, then log-sum-exp
    minus the target's logit, per position."""
    logits = local.astype(logits, "float32")  # the loss's statistics in float32 (core/precision.py)
    m = local.max(logits, -1)
    se = local.sum(local.exp(logits - m[..., None]), -1)
    picked = local.take_last(logits, ids) * local.cast(hit, logits)
    m, se, picked = combine(m, se, picked)
    return local.log(se) + m - picked


class DropoutKey:
    """What a dropout mask depends on besides the element: (seed, step). ``step`` is an int (any
    size: its low and high 32-bit words both key the mask, so step 2**32 + t is not step t) or,
    traced under JAX, the int32 pair ``step_words(t)``."""

    __slots__ = ("seed", "step", "step_hi", "row_stride", "row_offset")

    def __init__(self, seed: int = 0, step: Any = 0, *, rows: tuple[Any, Any] = (1, 0)):
        self.seed = np.int32(_i32(int(seed)))
        if isinstance(step, (int, np.integer)):
            step = step_words(int(step))
        self.step, self.step_hi = step[0], step[1]
        # Microbatch i of k holds the batch's rows i, i+k, ...: its row r is the batch's row r*k + i,
        # so a step in microbatches draws the masks the whole batch would (dim 0 is the batch dim).
        self.row_stride, self.row_offset = rows


def step_words(step: int) -> np.ndarray:
    """A step count (0 <= step < 2**64) as its (low, high) 32-bit words, int32: what a jitted
    function takes in place of an int that would overflow int32 after 2**31 steps."""
    if not 0 <= step < 1 << 64:
        raise ValueError(f"step {step} is outside [0, 2**64); a step counts updates from 0.")
    return np.array([_i32(step), _i32(step >> 32)], np.int32)


def _i32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


_M1, _M2 = np.int32(_i32(0x85EBCA6B)), np.int32(_i32(0xC2B2AE35))


def _mix(h):
    """murmur3's 32-bit finalizer on int32 arrays (wrapping multiplies, logical shifts), written
    with operators only, so numpy, torch and JAX compute the same bits."""
    h = h ^ ((h >> 16) & 0xFFFF)
    h = h * _M1
    h = h ^ ((h >> 13) & 0x7FFFF)
    h = h * _M2
    return h ^ ((h >> 16) & 0xFFFF)


def dropout_keep(coords: Sequence[Any], rate: float, key: str, rng: DropoutKey):
    """The keep mask (bool) at global ``coords`` (one int32 index array per dim, broadcastable):
    ``hash(seed, step, key, coords) >= rate * 2**24`` on its top 24 bits (``step`` as two words)."""
    import zlib

    coords = [coords[0] * rng.row_stride + rng.row_offset, *coords[1:]] if len(coords) else coords
    words = coords[0] * 0 + np.int32(_i32(zlib.crc32(key.encode())))
    words = _mix(words ^ rng.seed)
    words = _mix(words ^ rng.step)
    words = _mix(words ^ rng.step_hi)
    for c in coords:
        words = _mix(words ^ c)
    return ((words >> 8) & 0xFFFFFF) >= int(round(rate * (1 << 24)))


class DenseOps:
    """``Ops`` on whole arrays with a backend's ``LocalOps``: the single-device reference, and
    GSPMD mode's global arrays (``constrain`` and ``param`` hooks put sharding constraints there).
    ``training``: dropout on (with ``rng``) or off. ``dtype``: mixed precision's compute dtype
    (core/precision.py: floating operands are cast to it where an op computes; None: as they come)."""

    def __init__(self, local: LocalOps, *, constrain: Callable | None = None, param: Callable | None = None,
                 training: bool = True, rng: DropoutKey | None = None, dtype: str | None = None):
        self.local, self._constrain, self._param = local, constrain, param
        self.training, self.rng = training, rng or DropoutKey()
        self.dtype = dtype

    def _c(self, x):
        """An operand in the compute dtype."""
        return x if self.dtype is None else self.local.astype(x, self.dtype)

    def _cs(self, *xs) -> tuple:
        return tuple(self._c(x) for x in xs)

    def _wide(self, x):
        """A sum's operand in float32 (core/precision.py: every reduction runs in float32)."""
        return x if self.dtype is None else self.local.astype(x, "float32")

    def param(self, name, value, dims):
        return value if self._param is None else self._param(name, value, dims)

    def constrain(self, x, dims):
        return x if self._constrain is None else self._constrain(x, dims)

    def constant(self, value):
        return self.local.constant(np.asarray(value))

    def einsum(self, equation, *operands):
        return self.local.einsum(equation, *self._cs(*operands))

    def add(self, x, y):
        x, y = self._cs(x, y)
        return x + y  # shapes were checked when the program traced the model (core/shapes.py)

    def mul(self, x, y):
        x, y = self._cs(x, y)
        return x * y

    def add_bias(self, x, b):
        x, b = self._cs(x, b)
        return x + b  # b's dims are x's trailing dims

    def scale(self, x, c):
        return x * float(c)

    def gelu(self, x):
        return self.local.gelu(self._c(x))

    def silu(self, x):
        return self.local.silu(self._c(x))

    def relu(self, x):
        return self.local.relu(self._c(x))

    def tanh(self, x):
        return self.local.tanh(self._c(x))

    def softmax(self, x, dim=-1):
        return self.local.softmax(self._c(x), dim % len(x.shape))

    def sum(self, x, dim):
        return self.local.sum(self._wide(x), dim % len(x.shape))

    def mean(self, x, dim):
        d = dim % len(x.shape)
        return self.local.sum(self._wide(x), d) * (1.0 / x.shape[d])

    def rms_norm(self, x, scale, eps):
        return self.local.rms_norm(self._c(x), scale, eps)

    def layer_norm(self, x, scale, bias, eps):
        return self.local.layer_norm(self._c(x), scale, bias, eps)

    def embed(self, table, tokens):
        return self._c(self.local.take(table, tokens))

    def rotary(self, x, cos, sin):
        return self.local.rotary(*self._cs(x, cos, sin))

    def attention(self, q, k, v, *, causal=True):
        return self.local.attention(*self._cs(q, k, v), causal=causal)

    def dropout(self, x, rate, *, key):
        if not self.training or rate == 0:
            return x
        shape = tuple(x.shape)
        coords = [self.local.iota(shape, d) for d in range(len(shape))]
        keep = dropout_keep(coords, rate, key, self.rng)
        return self.local.where(keep, x * (1.0 / (1.0 - rate)), x * 0.0)

    def rearrange(self, x, pattern, **sizes):
        from .layouts import parse_rearrange

        parse_rearrange(pattern, tuple(x.shape), sizes)  # the same checks as the sharded executor
        return self.local.rearrange(x, pattern, sizes)

    def cross_entropy(self, logits, targets):
        return self.local.cross_entropy(self._c(logits), targets)
