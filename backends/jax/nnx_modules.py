"""parlay's layers and models as Flax NNX modules, trained in an ordinary NNX loop.

``Layer(layer)`` is one of parlay's neutral layers (``Linear``, ``Attention``, ``MLP``, ``Block``,
the norms, ``Embedding``: anything with ``decls(prefix)`` and ``layer(ops, params, prefix, ...)``)
as an NNX module; ``Model(model)`` is a whole parlay model (the GPT, ``examples/vit.py``: anything
meeting parlay's ``Model`` protocol), and ``GPT(config)`` the GPT. Their parameters are
``nnx.Param``s at the paths parlay names them by (``blocks.0.attn.wq``), each carrying its logical
dims as ``out_sharding`` metadata (Flax's logical annotation), and drawn as parlay draws them
(numpy, from the seed and the name), so an NNX module and parlay's run of the same model start
from the same bits. The forward is parlay's own, on JAX arrays.

Given a strategy and a mesh (``Model(model, strategy="fsdp+tp", mesh={"dp": 2, "tp": 4},
batch=8)``), a model's parameters are placed in the strategy's layouts (``NamedSharding``s on a
JAX mesh of the same axes) and its forward puts GSPMD's sharding constraints where parlay's GSPMD
mode puts them: each parameter's use and each constraint point. A ``Layer`` inside a user's own
NNX module takes its activations' layouts from the running parlay strategy when the module runs
as an ``NnxModel`` (backends/jax/nnx.py), and computes unconstrained otherwise.

``adamw(config)`` is parlay's optimizer as one optax transformation (the learning-rate schedule
included), for ``nnx.Optimizer``; ``checkpoint_tensors`` and ``restore`` are a module's side of
parlay's checkpoints, which ``parlay.flax_nnx.save_checkpoint`` and ``load_checkpoint`` write and
read (the top level: backends never import it).
"""

from __future__ import annotations

import weakref
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding

from ...core.layers import init_params
from ...core.mesh import Mesh
from ...core.model import check_model, model_init
from ...core.ops import DenseOps, DropoutKey
from ...core.optim import OptimizerConfig
from ...core.pieces import box
from ...core.program import make_program
from ...core.session import check_batch
from ...core.strategies import Role
from .env import use_host_devices
from .mesh import lower_layout, lower_mesh
from .nnx import constrain
from .ops import JaxLocal
from .session import checkpoint_pieces, gspmd_ops, make_optimizer

__all__ = ["Layer", "Model", "GPT", "Placement", "adamw", "adamw_config", "checkpoint_tensors", "restore"]


class Placement:
    """Where parlay's ``strategy`` puts ``model``'s tensors on ``mesh`` (axis name -> size) for
    batches of ``batch`` examples: a ``NamedSharding`` per parameter and input, and GSPMD's
    ``Ops``. ``devices``: the JAX devices in rank order (default: JAX's first mesh-size devices;
    on a CPU host it asks XLA for max(mesh size, 8) host devices, which takes effect only if JAX
    has not started yet)."""

    def __init__(self, model, strategy, mesh: Mapping[str, int] | Mesh, *, batch: int, devices=None):
        mesh = mesh if isinstance(mesh, Mesh) else Mesh(tuple(dict(mesh).items()))
        self.program = make_program(model, strategy, mesh, batch=batch)
        if devices is None:
            use_host_devices(max(mesh.size, 8))  # on a CPU host, before JAX starts (no effect after)
        self.jax_mesh = lower_mesh(self.program.mesh, devices, axis_type=AxisType.Auto)

    def sharding(self, layout) -> NamedSharding:
        return lower_layout(layout, self.jax_mesh)

    def param(self, name: str) -> NamedSharding:
        """Parameter ``name``'s stored layout (what its value, gradient and optimizer states hold)."""
        return self.sharding(self.program.layouts[Role.PARAMS][name])

    def batch(self, batch: Mapping[str, Any]) -> dict[str, jax.Array]:
        """A batch's arrays, checked against the model's inputs and placed in their layouts."""
        acts = self.program.layouts[Role.ACTIVATIONS]
        return {k: jax.device_put(v, self.sharding(acts[k])) for k, v in check_batch(self.program, batch).items()}

    def ops(self, training: bool, rng: DropoutKey) -> DenseOps:
        return gspmd_ops(self.program, self.sharding, training=training, rng=rng)


def _unplaced_ops(training: bool, rng: DropoutKey) -> DenseOps:
    """Whole arrays; constraint points take the running parlay strategy's layouts inside an
    ``NnxModel`` run (``nnx.constrain``) and are the identity outside one."""
    return DenseOps(JaxLocal(), constrain=constrain, training=training, rng=rng)


def _tree(params: Mapping[str, nnx.Param], what: str) -> dict[str, Any]:
    """Dotted names as nested ``nnx.Dict``s: ``{"blocks": Dict({"0": Dict({"attn": ...})})}``, so
    each parameter's NNX path is its parlay name."""
    top: dict[str, Any] = {}
    for name, p in params.items():
        *groups, leaf = name.split(".")
        node = top
        for i, g in enumerate(groups):
            node = node.setdefault(g, {})
            if not isinstance(node, dict):
                raise ValueError(f"{what}: parameter {name!r} nests under {'.'.join(groups[:i + 1])!r}, which is "
                                 f"itself a parameter; an NNX module cannot hold both")
        if leaf in node:
            raise ValueError(f"{what}: parameter {name!r} names a group of other parameters too")
        node[leaf] = p
    nest = lambda node: nnx.Dict({k: nest(v) for k, v in node.items()}) if isinstance(node, dict) else node
    return {k: nest(v) for k, v in top.items()}


def _param(value, dims, sharding=None) -> nnx.Param:
    """An ``nnx.Param`` of float32 ``value`` (placed with ``sharding`` if given) annotated with its
    logical dims as Flax annotates them; Flax's eager sharding stays off (the dims are logical
    names, not mesh axes: parlay places the value)."""
    value = np.asarray(value, np.float32)
    value = jnp.asarray(value) if sharding is None else jax.device_put(value, sharding)
    return nnx.Param(value, out_sharding=tuple(dims), eager_sharding=False)


def _flat(module: nnx.Module) -> dict[str, Any]:
    """The module's parameters by dotted name."""
    return {".".join(map(str, path)): v for path, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}


def _values(what: str, decls, given: Mapping[str, Any], names: Sequence[str]) -> dict[str, np.ndarray]:
    """``given`` parameter values by declared name, every one present, none unknown, each of its
    declared shape."""
    given = dict(given)
    missing = [n for n in names if n not in given]
    unknown = [k for k in given if k not in names]
    if missing or unknown:
        raise ValueError(f"{what}: params " + "; ".join(
            ([f"lacks {missing[:4]}{' ...' if len(missing) > 4 else ''}"] if missing else [])
            + ([f"names {unknown[:4]} that it does not declare"] if unknown else [])) + f"; it declares {list(names)[:8]}"
            + (" ..." if len(names) > 8 else ""))
    out = {}
    for n, d in zip(names, decls):
        v = np.asarray(given[n], np.float32)
        if v.shape != tuple(d.shape):
            raise ValueError(f"{what}: params[{n!r}] has shape {v.shape}; it declares {tuple(d.shape)} "
                             f"(dims {d.dims})")
        out[n] = v
    return out


def _check_inputs(model, batch: Mapping[str, Any], what: str) -> None:
    """``batch`` against the model's declared inputs for its first array's batch size: every input,
    its shape, integer or floating dtype (values are not read: under jit they are traced)."""
    if not batch:
        raise ValueError(f"{what}: the batch is empty; the model reads {sorted(model.inputs(1))}")
    n = int(np.shape(next(iter(batch.values())))[0]) if np.ndim(next(iter(batch.values()))) else 0
    want = model.inputs(max(n, 1))
    missing = sorted(set(want) - set(batch))
    if missing:
        raise ValueError(f"{what}: the batch lacks input {missing[0]!r}; the model reads {sorted(want)}")
    for name, d in want.items():
        x = batch[name]
        dtype = np.dtype(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype)
        if tuple(np.shape(x)) != d.shape:
            raise ValueError(f"{what}: input {name!r} has shape {tuple(np.shape(x))}; the model takes {d.shape} for a "
                             f"batch of {n} (dims {d.dims})")
        if (dtype.kind in "iu") != (d.dtype.numpy.kind in "iu"):
            raise ValueError(f"{what}: input {name!r} is {dtype}; the model takes {d.dtype.value}")


def _dropout_key(seed: int, step) -> DropoutKey:
    """Dropout's key for update ``step``: an int, or ``step_words(t)`` traced under jit."""
    return DropoutKey(seed, 0 if step is None else step)


class Layer(nnx.Module):
    """One of parlay's neutral layers as an NNX module: ``Layer(Linear((64,), (128,), ("embed",),
    ("mlp",)))(x)`` computes ``x @ w`` with ``w`` an ``nnx.Param`` named ``w``, dims
    ``("embed", "mlp")``. ``seed``: parlay's initializer's seed (each parameter drawn from the seed
    and its name); ``params``: the values instead, by the names ``layer.decls("")`` gives without
    the leading dot. Call it with the layer's own arguments: ``Attention`` takes ``x, cos, sin``
    (the rotary tables, or ``None, None`` where positions were added to the embeddings), ``Block``
    ``x`` and optionally ``cos, sin``, the others ``x`` (``Embedding``: int tokens)."""

    def __init__(self, layer, *, seed: int = 0, params: Mapping[str, Any] | None = None):
        if not (callable(getattr(layer, "decls", None)) and callable(layer)):
            raise TypeError(f"Layer: {type(layer).__name__} is not a parlay layer (one with decls(prefix) and "
                            f"__call__(ops, params, prefix, ...): parlay.core.layers); a whole model goes in Model()")
        decls = tuple(layer.decls("_"))
        names = [d.name[2:] for d in decls]
        what = f"Layer({type(layer).__name__})"
        drawn = init_params(decls, seed) if params is None else None
        values = {n: drawn[f"_.{n}"] for n in names} if drawn is not None else _values(what, decls, params, names)
        self.layer = layer
        self.deterministic = True  # nnx's train()/eval() set it: dropout only when False
        self.seed = seed
        for k, v in _tree({n: _param(values[n], d.dims) for n, d in zip(names, decls)}, what).items():
            setattr(self, k, v)

    def __call__(self, *args, step=None, **kwargs):
        flat = {f"_.{k}": v[...] for k, v in _flat(self).items()}
        ops = _unplaced_ops(not self.deterministic, _dropout_key(self.seed, step))
        return self.layer(ops, flat, "_", *args, **kwargs)


class Model(nnx.Module):
    """A parlay model (``decls``, ``inputs``, ``loss``; ``logits`` where it has them) as an NNX
    module: ``module.loss(batch)`` is the model's loss, ``module(tokens)`` its logits. With
    ``strategy`` and ``mesh`` (and ``batch``, the examples a step), parameters live in the
    strategy's layouts and the forward carries its sharding constraints (``placement``); without,
    it computes on whole arrays. ``seed``: parlay's initializer's seed; ``params``: the values
    instead, by name. In train mode (``module.train()``) a model with dropout draws parlay's masks
    for update ``step`` (an int, or ``parlay.core.ops.step_words(t)`` under ``nnx.jit``)."""

    def __init__(self, model, *, seed: int = 0, params: Mapping[str, Any] | None = None, strategy=None,
                 mesh: Mapping[str, int] | Mesh | None = None, batch: int | None = None, devices=None):
        model = check_model(model)
        given = {"strategy": strategy, "mesh": mesh, "batch": batch}
        if any(v is not None for v in given.values()) and any(v is None for v in given.values()):
            raise ValueError(f"Model: give strategy=, mesh= and batch= together (a placement), or none of them (whole "
                             f"arrays); {', '.join(k + '=' for k, v in given.items() if v is None)} missing")
        self.model = model
        self.placement = None if strategy is None else Placement(model, strategy, mesh, batch=batch, devices=devices)
        self.deterministic = True
        self.seed = seed
        decls = tuple(model.decls())
        values = (model_init(model, seed) if params is None
                  else _values(f"Model({type(model).__name__})", decls, params, [d.name for d in decls]))
        place = (lambda n: None) if self.placement is None else self.placement.param
        tree = _tree({d.name: _param(values[d.name], d.dims, place(d.name)) for d in decls}, type(model).__name__)
        taken = [k for k in tree if hasattr(self, k) or hasattr(type(self), k)]
        if taken:
            raise ValueError(f"Model: the parameters {taken} are named as the module's own attributes; rename them "
                             f"in the model's decls")
        for k, v in tree.items():
            setattr(self, k, v)

    def _run(self, step):
        """The ``Ops`` and the parameters by name (each a JAX array)."""
        rng = _dropout_key(self.seed, step)
        training = not self.deterministic
        ops = _unplaced_ops(training, rng) if self.placement is None else self.placement.ops(training, rng)
        return ops, {k: v[...] for k, v in _flat(self).items()}

    def loss(self, batch: Mapping[str, Any], *, step=None):
        _check_inputs(self.model, batch, f"{type(self.model).__name__}.loss")
        ops, params = self._run(step)
        return self.model.loss(ops, params, batch)

    def __call__(self, *args, step=None):
        if not callable(getattr(self.model, "logits", None)):
            raise TypeError(f"{type(self.model).__name__} has no logits(ops, params, ...); call module.loss(batch)")
        ops, params = self._run(step)
        return self.model.logits(ops, params, *args)

    def shardings(self) -> dict[str, NamedSharding]:
        """Each parameter's stored ``NamedSharding`` (empty without a placement)."""
        if self.placement is None:
            return {}
        return {d.name: self.placement.param(d.name) for d in self.model.decls()}


class GPT(Model):
    """parlay's GPT (``parlay.core.models.gpt``) as an NNX module: ``GPT(config)(tokens)`` gives
    (B, S, vocab) logits; ``config``: a ``GPTConfig`` or a preset's name ("tiny")."""

    def __init__(self, config, **kwargs):
        from ...core.models.gpt import GPT as Neutral, GPTConfig

        if isinstance(config, str):
            from ...core.loading import load_model

            model, _ = load_model(config)
            if not isinstance(model, Neutral):
                raise ValueError(f"GPT({config!r}): {config!r} is not a GPT preset")
        elif isinstance(config, GPTConfig):
            model = Neutral(config)
        else:
            raise TypeError(f"GPT(config): a GPTConfig or a preset's name, not {type(config).__name__}")
        super().__init__(model, **kwargs)

    def __call__(self, tokens, *, step=None):
        """(B, S, vocab) logits of (B, S) int tokens, S the config's seq (token values are not
        checked: under jit they are traced, and JAX clamps an index past the vocabulary)."""
        _check_inputs(self.model, {"tokens": tokens, "targets": tokens}, "GPT")
        return super().__call__(tokens, step=step)


def adamw(config: OptimizerConfig) -> optax.GradientTransformation:
    """parlay's optimizer (global-norm clipping, AdamW, the warmup-cosine schedule of ``config``)
    as one optax transformation for ``nnx.Optimizer``: the steps parlay's sessions take, bit for
    bit where XLA computes them alike. The schedule is read from a float32 table of
    ``config.lr_at`` (computed in float64, as every backend computes it), whose last entry holds
    once warmup and decay are over."""
    last = max(config.warmup, config.decay_steps)
    table = jnp.asarray([np.float32(config.lr_at(t)) for t in range(last + 1)], jnp.float32)
    rate = lambda count: -table[jnp.minimum(count, last)]
    tx = optax.chain(make_optimizer(config), optax.scale_by_schedule(rate))
    _ADAMW[tx.update] = config
    return tx


_ADAMW: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # adamw()'s update function -> its config


def adamw_config(optimizer: nnx.Optimizer) -> OptimizerConfig:
    """The ``OptimizerConfig`` of ``adamw(config)`` that ``optimizer`` (an ``nnx.Optimizer``) steps
    with; a ``ValueError`` for any other optax transformation (its state is not parlay's)."""
    tx = getattr(optimizer, "tx", None)
    config = _ADAMW.get(getattr(tx, "update", None)) if tx is not None else None
    if config is None:
        raise ValueError(f"the nnx.Optimizer steps with {type(tx).__name__ if tx is not None else 'no transformation'} "
                         f"that parlay.flax_nnx.adamw(config) did not make; parlay's checkpoints hold its AdamW "
                         f"states and schedule: make it as nnx.Optimizer(module, adamw(config), wrt=nnx.Param)")
    return config


def _opt_moments(optimizer: nnx.Optimizer) -> dict[tuple[str, str], jax.Array]:
    """Adam's moments in ``optimizer``'s state: {("mu" | "nu", parameter name): array}."""
    out = {}
    for path, v in nnx.to_flat_state(nnx.state(optimizer, nnx.OptState)):
        keys = [str(k) for k in path]
        kind = next((i for i, k in enumerate(keys) if k in ("mu", "nu")), None)
        if kind is not None:
            out[keys[kind], ".".join(keys[kind + 1:])] = v[...]
    return out


def checkpoint_tensors(module: Model, optimizer: nnx.Optimizer, batch: int):
    """A parlay checkpoint's tensors of ``module`` and ``optimizer`` (an ``nnx.Optimizer`` of
    ``adamw``), in the module's own layouts (a one-device mesh without a placement): ``(tensors,
    blocks, count, program)`` as a session's ``checkpoint_tensors`` gives them, and the program of
    the module's strategy and mesh (the top level's ``parlay.flax_nnx.save_checkpoint`` writes them)."""
    place = module.placement or Placement(module.model, "dp", {"dp": 1}, batch=batch)
    lay, moments = place.program.layouts, _opt_moments(optimizer)
    named = []
    for name, v in _flat(module).items():
        named.append((f"params/{name}", v[...], lay[Role.PARAMS][name]))
        for kind in ("mu", "nu"):
            if (kind, name) not in moments:
                raise ValueError(f"save_checkpoint: the optimizer holds no Adam {kind} for {name!r}; make it as "
                                 f"nnx.Optimizer(module, adamw(config), wrt=nnx.Param)")
            named.append((f"opt/{kind}/{name}", moments[kind, name], lay[Role.OPTIMIZER][name]))
    named = [(n, jax.device_put(a, place.sharding(layout)), layout) for n, a, layout in named]
    return (*checkpoint_pieces(named, place.jax_mesh), int(optimizer.step[...]), place.program)


def _read(ckpt, name: str, like: jax.Array) -> jax.Array:
    """Tensor ``name`` of ``ckpt`` in ``like``'s shape and sharding: each device reads only the
    pieces its block overlaps (each piece's SHA-256 checked)."""
    shape = tuple(like.shape)
    return jax.make_array_from_callback(shape, like.sharding, lambda index: ckpt.read(
        name, tuple(map(slice, *box(index, shape))), shape=shape))


def restore(module: Model, ckpt, optimizer: nnx.Optimizer | None = None) -> None:
    """Read an opened parlay checkpoint (``parlay.checkpoint.Checkpoint``, its names checked by
    the caller) into ``module``, each parameter in the sharding it has; with ``optimizer``, Adam's
    moments and the update count (optax's int32 counts saturate, as a session's do)."""
    state = nnx.state(module, nnx.Param)
    flat = [(p, v.replace(_read(ckpt, "params/" + ".".join(map(str, p)), v[...]))) for p, v in nnx.to_flat_state(state)]
    nnx.update(module, nnx.from_flat_state(flat))
    if optimizer is None:
        return
    count, flat = ckpt.count(), []
    for p, v in nnx.to_flat_state(nnx.state(optimizer, nnx.OptState)):
        keys = [str(k) for k in p]
        kind = next((i for i, k in enumerate(keys) if k in ("mu", "nu")), None)
        old = v[...]
        if kind is not None:
            new = _read(ckpt, f"opt/{keys[kind]}/{'.'.join(keys[kind + 1:])}", old)
        elif keys[-1] in ("count", "step"):  # optax's counts (int32: they saturate) and nnx's step
            new = jnp.asarray(min(count, np.iinfo(old.dtype).max), old.dtype)  # uncommitted, as optax made it
        else:
            raise ValueError(f"the optimizer's state {'.'.join(keys)} is not adamw()'s (Adam's moments and counts); "
                             f"make it as nnx.Optimizer(module, adamw(config), wrt=nnx.Param)")
        flat.append((p, v.replace(new)))
    nnx.update(optimizer, nnx.from_flat_state(flat))
