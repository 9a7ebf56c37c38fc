"""Running a model on shapes alone: what it declares and calls, before any backend runs it.

``trace(model, batch)`` calls ``model.loss`` with ``ShapeOps``, whose values carry a shape and a
dtype and nothing else. It records every parameter use and every constraint point (logical dims
and shape), so a ``Program`` can resolve and check each layout once, and it checks the shapes of
every op on the way (an einsum whose letters disagree fails here, with the op's name).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .einsum import parse_einsum
from .layouts import parse_rearrange
from .model import DType, Model
from .ops import ELEMENTWISE, LogicalDims

__all__ = ["Abstract", "ShapeOps", "Trace", "TraceError", "trace", "part_params"]


def _opaque(self, *args, **kwargs):
    raise TypeError("parlay's tensors take no Python operators or numpy functions: every computation goes through "
                    "the ops (ops.add, ops.mul, ops.scale, ops.add_bias, ops.relu, ops.einsum, ...; see "
                    "parlay.core.ops.Ops), so that each backend can run it on its blocks.")


@dataclass(frozen=True)
class Abstract:
    shape: tuple[int, ...]
    dtype: DType = DType.FLOAT32

    @property
    def ndim(self) -> int:
        return len(self.shape)

    # A model that computes on tensors directly would run here and fail on a backend's blocks.
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _opaque
    __matmul__ = __rmatmul__ = __pow__ = __neg__ = __lt__ = __le__ = __gt__ = __ge__ = __getitem__ = _opaque
    __array__ = __array_ufunc__ = __array_function__ = __float__ = __int__ = __bool__ = _opaque


@dataclass
class Trace:
    """What one call of ``model.loss`` did: parameter uses (name, dims, shape), constraint points
    (dims, shape) in call order, and the loss's shape."""

    params: list = field(default_factory=list)
    constraints: list = field(default_factory=list)
    loss: tuple | None = None
    largest: tuple = ()  # the shape of the largest value an op returned: it must exist at some point

    def note(self, out) -> None:
        if isinstance(out, Abstract) and int(np.prod(out.shape)) > int(np.prod(self.largest)):
            self.largest = out.shape


class ShapeOps:
    def __init__(self):
        self.trace = Trace()

    def param(self, name: str, value: Abstract, dims: LogicalDims) -> Abstract:
        if len(tuple(dims)) != value.ndim:
            raise ValueError(f"ops.param({name!r}): logical dims {tuple(dims)} name {len(tuple(dims))} dims but the "
                             f"parameter has shape {value.shape}.")
        self.trace.params.append((name, tuple(dims), value.shape))
        return value

    def constrain(self, x: Abstract, dims: LogicalDims) -> Abstract:
        if isinstance(dims, str) or len(tuple(dims)) != x.ndim:
            raise ValueError(f"ops.constrain: logical dims {dims!r} must name each of the {x.ndim} dims of a tensor of "
                             f"shape {x.shape}.")
        self.trace.constraints.append((tuple(dims), x.shape))
        return x

    def constant(self, value) -> Abstract:
        return Abstract(tuple(np.shape(value)))

    def einsum(self, equation: str, *operands: Abstract) -> Abstract:
        terms, out = parse_einsum(equation, len(operands))
        size: dict[str, int] = {}
        for i, (t, o) in enumerate(zip(terms, operands)):
            if len(t) != o.ndim:
                raise ValueError(f"einsum {equation!r}: operand {i} is {t!r} ({len(t)} dims) but has shape {o.shape}.")
            for c, n in zip(t, o.shape):
                if size.setdefault(c, n) != n:
                    raise ValueError(f"einsum {equation!r}: letter {c!r} has size {size[c]} and {n} in different operands.")
        return Abstract(tuple(size[c] for c in out))

    def _same(self, op: str, x: Abstract, y: Abstract) -> Abstract:
        if x.shape != y.shape:
            raise ValueError(f"{op}: shapes {x.shape} and {y.shape} differ; {op} is elementwise on equal shapes "
                             f"(add_bias adds a tensor over trailing dims).")
        return x

    def add(self, x, y):
        return self._same("add", x, y)

    def mul(self, x, y):
        return self._same("mul", x, y)

    def add_bias(self, x: Abstract, b: Abstract) -> Abstract:
        if b.ndim > x.ndim or x.shape[x.ndim - b.ndim:] != b.shape:
            raise ValueError(f"add_bias: the bias has shape {b.shape}, not x's trailing dims (x: {x.shape}).")
        return x

    def scale(self, x: Abstract, c: float) -> Abstract:
        if not isinstance(c, (int, float)) or isinstance(c, bool):
            raise TypeError(f"scale: c must be a Python number, got {c!r}.")
        return x

    def __getattr__(self, name: str):
        if name in ELEMENTWISE:
            return lambda x: x
        raise AttributeError(f"ShapeOps has no op {name!r}; the ops a model may call are parlay.core.ops.Ops'")

    def _dim(self, op: str, x: Abstract, dim: int) -> int:
        if not -x.ndim <= dim < x.ndim:
            raise ValueError(f"{op}: dim {dim} is out of range for shape {x.shape}.")
        return dim % x.ndim

    def softmax(self, x: Abstract, dim: int = -1) -> Abstract:
        self._dim("softmax", x, dim)
        return x

    def sum(self, x: Abstract, dim: int) -> Abstract:
        d = self._dim("sum", x, dim)
        return Abstract(x.shape[:d] + x.shape[d + 1:], x.dtype)

    def mean(self, x: Abstract, dim: int) -> Abstract:
        d = self._dim("mean", x, dim)
        return Abstract(x.shape[:d] + x.shape[d + 1:], x.dtype)

    def _norm(self, op: str, x: Abstract, *params: Abstract) -> Abstract:
        for p in params:
            if p.shape != x.shape[-1:]:
                raise ValueError(f"{op}: a scale or bias of shape {p.shape} for x of shape {x.shape}; they are (D,) "
                                 f"over the last dim.")
        return x

    def rms_norm(self, x, scale, eps):
        return self._norm("rms_norm", x, scale)

    def layer_norm(self, x, scale, bias, eps):
        return self._norm("layer_norm", x, scale, bias)

    def embed(self, table: Abstract, tokens: Abstract) -> Abstract:
        if table.ndim != 2 or tokens.dtype is not DType.INT32:
            raise ValueError(f"embed: a (V, E) table and int ids, got shape {table.shape} and {tokens.dtype.value} ids.")
        return Abstract(tokens.shape + (table.shape[1],))

    def rotary(self, x: Abstract, cos: Abstract, sin: Abstract) -> Abstract:
        if x.ndim != 4 or cos.shape != (x.shape[1], x.shape[3] // 2) or sin.shape != cos.shape:
            raise ValueError(f"rotary: x is (B, S, H, D) and the tables (S, D/2); got {x.shape}, {cos.shape}, {sin.shape}.")
        return x

    def attention(self, q: Abstract, k: Abstract, v: Abstract, *, causal: bool = True) -> Abstract:
        if q.ndim != 4 or k.shape != v.shape or k.ndim != 4 or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3] \
                or q.shape[2] % k.shape[2]:
            raise ValueError(f"attention: q (B, S, H, D), k and v (B, S, Hkv, D) with Hkv dividing H; got {q.shape}, "
                             f"{k.shape}, {v.shape}.")
        return q

    def dropout(self, x: Abstract, rate: float, *, key: str) -> Abstract:
        if not 0 <= rate < 1:
            raise ValueError(f"dropout rate {rate!r} must be in [0, 1).")
        return x

    def rearrange(self, x: Abstract, pattern: str, **sizes: int) -> Abstract:
        return Abstract(parse_rearrange(pattern, x.shape, sizes).out_shape, x.dtype)

    def cross_entropy(self, logits: Abstract, targets: Abstract) -> Abstract:
        if targets.shape != logits.shape[:-1] or targets.dtype is not DType.INT32:
            raise ValueError(f"cross_entropy: logits {logits.shape} need int targets of shape {logits.shape[:-1]}, got "
                             f"{targets.dtype.value} {targets.shape}.")
        return Abstract(())


class _Noting:
    """``ShapeOps`` that notes every op's result in the trace (``Trace.largest``)."""

    def __init__(self, ops: ShapeOps):
        self._ops = ops

    def __getattr__(self, name: str):
        op = getattr(self._ops, name)
        if not callable(op):
            return op

        def call(*args, **kwargs):
            out = op(*args, **kwargs)
            self._ops.trace.note(out)
            return out
        return call


class TraceError(ValueError):
    """``model.loss`` failed on shapes; the message names the model's line."""


def _where(tb) -> str:
    """The innermost frame of the model's own code (not of parlay's ops machinery)."""
    import os
    import traceback

    here = os.path.dirname(os.path.abspath(__file__))
    machinery = {os.path.join(here, f) for f in ("shapes.py", "einsum.py", "layouts.py", "ops.py", "rules.py",
                                                  "spec.py", "program.py")}
    frames = [f for f in traceback.extract_tb(tb) if os.path.abspath(f.filename) not in machinery]
    if not frames:
        return ""
    f = frames[-1]
    return f" (at {f.filename}:{f.lineno}, in {f.name}: {f.line})"


def trace(model: Model, batch: int) -> Trace:
    """``model.loss`` on shapes: parameters from ``decls()``, inputs from ``inputs(batch)``. Any
    error the model's code raises becomes one ``TraceError`` naming the model's line."""
    ops = ShapeOps()
    params = {d.name: Abstract(d.shape) for d in model.decls()}
    inputs = {k: Abstract(d.shape, d.dtype) for k, d in model.inputs(batch).items()}
    try:
        out = model.loss(_Noting(ops), params, inputs)
    except Exception as e:
        hint = ""
        if isinstance(e, KeyError):
            hint = (f"; params holds the parameters decls() declares ({', '.join(sorted(params)[:8])}"
                    f"{', ...' if len(params) > 8 else ''}) and batch the inputs inputs() declares "
                    f"({', '.join(sorted(inputs))})")
        raise TraceError(f"model.loss failed while parlay traced it on shapes: {type(e).__name__}: {e}{hint}"
                         f"{_where(e.__traceback__)}") from None
    if not isinstance(out, Abstract):
        raise TypeError(f"model.loss returned {type(out).__name__}; it must return the result of an op (the loss).")
    ops.trace.loss = out.shape
    return ops.trace


def part_params(model, batch: int) -> dict:
    """The parameters each part of a pipelined model uses, by tracing its ``embed``, every
    ``layer(i)`` and its ``head`` on shapes: {"embed": names, 0: names, ..., "head": names}."""
    params = {d.name: Abstract(d.shape) for d in model.decls()}
    inputs = {k: Abstract(d.shape, d.dtype) for k, d in model.inputs(batch).items()}
    out: dict = {}

    def run(part, fn):
        ops = ShapeOps()
        try:
            value = fn(_Noting(ops))
        except Exception as e:
            raise TraceError(f"model.{part if isinstance(part, str) else 'layer'} failed while parlay traced it on "
                             f"shapes: {type(e).__name__}: {e}{_where(e.__traceback__)}") from None
        out[part] = {name for name, _, _ in ops.trace.params}
        return value

    x = run("embed", lambda o: model.embed(o, params, inputs))
    for i in range(int(model.layers())):
        x = run(i, lambda o, i=i, x=x: model.layer(o, params, i, x))
    run("head", lambda o: model.head(o, params, x, inputs))
    return out
