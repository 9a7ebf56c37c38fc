"""Training steps on JAX: the single-device reference and GSPMD mode (jit with shardings).

GSPMD mode keeps global arrays: parameters, gradients and optimizer states get the strategy's
layouts as shardings, activations get ``with_sharding_constraint`` at the model's constraint
points, and XLA chooses the collectives.
"""

from __future__ import annotations

import enum
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from ...core import Layout, Mesh
from ...core.model import GPT, TOKENS
from ...core.optim import OptimizerConfig
from ...core.strategies import Strategy, get_strategy
from .collectives import AtomMesh, CollectiveLog
from .distributed import fetch, put
from .explicit import ExplicitOps, Sharded
from .mesh import lower_layout, lower_mesh
from .ops import JaxOps

__all__ = ["Mode", "OptimizerConfig", "TrainStep", "make_optimizer"]


class Mode(enum.Enum):
    SINGLE = "single"  # one device, no sharding: the reference
    GSPMD = "gspmd"  # jit + NamedSharding + with_sharding_constraint
    EXPLICIT = "explicit"  # shard_map + core plans executed with lax collectives


def _box(index, shape) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(start, stop) per dim of a shard's index (slices that may say None)."""
    bounds = [sl.indices(n)[:2] for sl, n in zip(index, shape)]
    return tuple(a for a, _ in bounds), tuple(b for _, b in bounds)


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    lr = cfg.lr if cfg.constant else (lambda count: cfg.lr_at(count, jnp))  # count: updates done so far
    return optax.chain(
        optax.clip_by_global_norm(cfg.clip),
        optax.adamw(lr, b1=cfg.beta1, b2=cfg.beta2, eps=cfg.eps, weight_decay=cfg.weight_decay),
    )


class TrainStep:
    """``state = step.init(params)``; ``state, loss = step(state, tokens, targets)``;
    ``loss, grads = step.loss_and_grads(state, tokens, targets)`` (grads as numpy, global)."""

    def __init__(self, model: GPT, *, strategy: str | Strategy | None = None, mesh: Mesh | None = None,
                 mode: Mode | str = Mode.GSPMD, optimizer: OptimizerConfig = OptimizerConfig(),
                 batch: int | None = None, devices=None):
        self.model, self.mode = model, Mode(mode)
        self.log = CollectiveLog()  # explicit mode: the plan steps the traced step executed
        self.tx = make_optimizer(optimizer)
        if self.mode is Mode.SINGLE:
            self.strategy = self.mesh = self.jax_mesh = None
            self.device = (devices or jax.devices())[0]
        else:
            if strategy is None or mesh is None:
                raise ValueError(f"mode {self.mode.value!r} needs a strategy and a mesh.")
            self.strategy, self.mesh = get_strategy(strategy), mesh
            self.strategy.check(mesh, model.config, batch=batch)
            if self.mode is Mode.EXPLICIT:
                self.atoms = AtomMesh(mesh)
                self.jax_mesh = self.atoms.jax_mesh(devices)
            else:
                self.jax_mesh = lower_mesh(mesh, devices, axis_type=AxisType.Auto)
            dims, shapes = model.param_dims(), model.param_shapes()
            self.layouts = {role: self.strategy.layouts(role, dims, mesh, shapes)
                            for role in ("params", "compute", "grads", "optimizer")}
        self._step = jax.jit(self._train_step, donate_argnums=0)
        self._grads = jax.jit(self._loss_and_grads)

    # -- shardings -------------------------------------------------------------------------------
    def _sharding(self, layout: Layout) -> NamedSharding:
        if self.mode is Mode.EXPLICIT:
            return NamedSharding(self.jax_mesh, self.atoms.spec(layout))
        return lower_layout(layout, self.jax_mesh)

    def _activation(self, x, dims):
        spec = self.strategy.rules("activations").resolve(dims, self.mesh, name=f"activation {tuple(dims)}")
        layout = Layout(self.mesh, spec)
        layout.check(x.shape)
        return jax.lax.with_sharding_constraint(x, self._sharding(layout))

    def _ops(self) -> JaxOps:
        if self.mode is Mode.SINGLE:
            return JaxOps()
        compute = lambda x, dims: jax.lax.with_sharding_constraint(
            x, self._sharding(Layout(self.mesh, self.strategy.rules("compute").resolve(dims, self.mesh))))
        return JaxOps(constrain=self._activation, param=compute)

    def _place(self, tree: Mapping[str, Any], role: str):
        if self.mode is Mode.SINGLE:
            return {k: jax.device_put(np.asarray(v), self.device) for k, v in tree.items()}
        return {k: put(v, self._sharding(self.layouts[role][k])) for k, v in tree.items()}

    def _place_batch(self, x):
        if self.mode is Mode.SINGLE:
            return jax.device_put(np.asarray(x), self.device)
        spec = self.strategy.rules("activations").resolve(TOKENS, self.mesh)
        return put(x, self._sharding(Layout(self.mesh, spec)))

    # -- the step ----------------------------------------------------------------------------------
    def init(self, params: Mapping[str, np.ndarray]):
        p = self._place(params, "params")
        if self.mode is Mode.SINGLE:
            return {"params": p, "opt": jax.jit(self.tx.init)(p)}
        return {"params": p, "opt": self.init_opt(p)}

    def init_opt(self, params):
        """Optimizer states made where they live, in the optimizer layouts (works across processes)."""
        init = lambda p: jax.tree_util.tree_map_with_path(self._place_opt_leaf, self.tx.init(p))
        return jax.jit(init)(params)

    def _place_opt_leaf(self, path, leaf):
        name = getattr(path[-1], "key", None)
        if isinstance(name, str) and name in self.layouts["optimizer"] and leaf.ndim:
            return jax.lax.with_sharding_constraint(leaf, self._sharding(self.layouts["optimizer"][name]))
        return jax.lax.with_sharding_constraint(leaf, NamedSharding(self.jax_mesh, PartitionSpec()))

    def _loss(self, params, tokens, targets):
        if self.mode is Mode.EXPLICIT:
            return self._explicit_loss(params, tokens, targets)
        return self.model.loss(self._ops(), params, tokens, targets)

    def _explicit_loss(self, params, tokens, targets, wrap_ops=None):
        """The whole forward in shard_map; every redistribution is a core plan on lax collectives.
        ``wrap_ops(ops)``, if given, wraps the executor (the bisect records every op through it)."""
        mesh, strategy, atoms = self.mesh, self.strategy, self.atoms
        layouts, shapes = self.layouts["params"], self.model.param_shapes()
        tok_layout = Layout(mesh, strategy.rules("activations").resolve(TOKENS, mesh))
        tok_shape = tuple(tokens.shape)
        activation = lambda dims: strategy.rules("activations").resolve(dims, mesh, name=f"activation {tuple(dims)}")
        compute = lambda name, dims: strategy.rules("compute").resolve(dims, mesh, name=name)

        def local(p, x, y):
            ops = ExplicitOps(atoms, activation=activation, compute=compute, log=self.log)
            ops = wrap_ops(ops) if wrap_ops is not None else ops
            p = {k: Sharded(v, layouts[k], shapes[k]) for k, v in p.items()}
            x, y = Sharded(x, tok_layout, tok_shape), Sharded(y, tok_layout, tok_shape)
            return self.model.loss(ops, p, x, y).local

        in_specs = ({k: atoms.spec(layouts[k]) for k in params}, atoms.spec(tok_layout), atoms.spec(tok_layout))
        return jax.shard_map(local, mesh=self.jax_mesh, in_specs=in_specs, out_specs=PartitionSpec())(
            params, tokens, targets)

    def _loss_and_grads(self, params, tokens, targets):
        loss, grads = jax.value_and_grad(self._loss)(params, tokens, targets)
        if self.mode is not Mode.SINGLE:
            grads = {k: jax.lax.with_sharding_constraint(g, self._sharding(self.layouts["grads"][k]))
                     for k, g in grads.items()}
        return loss, grads

    def _train_step(self, state, tokens, targets):
        loss, grads = self._loss_and_grads(state["params"], tokens, targets)
        updates, opt = self.tx.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        if self.mode is not Mode.SINGLE:
            params = {k: jax.lax.with_sharding_constraint(v, self._sharding(self.layouts["params"][k]))
                      for k, v in params.items()}
        return {"params": params, "opt": opt}, loss

    def __call__(self, state, tokens, targets):
        return self._step(state, self._place_batch(tokens), self._place_batch(targets))

    def eval_loss(self, state, tokens, targets) -> float:
        """The loss alone (no gradients): held-out evaluation."""
        if not hasattr(self, "_eval"):
            self._eval = jax.jit(self._loss)
        return float(fetch(self._eval(state["params"], self._place_batch(tokens), self._place_batch(targets))))

    def loss_and_grads(self, state, tokens, targets) -> tuple[float, dict[str, np.ndarray]]:
        loss, grads = self._grads(state["params"], self._place_batch(tokens), self._place_batch(targets))
        return float(fetch(loss)), {k: fetch(v) for k, v in grads.items()}

    # -- checkpoints: blocks in, blocks out (no whole tensor on the host) ----------------------------
    def _opt_leaves(self, opt):
        """(kind, name, leaf) for each optimizer-state leaf: ("mu"|"nu", param name) or ("count", None)."""
        out = []
        for path, leaf in jax.tree_util.tree_flatten_with_path(opt)[0]:
            attrs = [getattr(k, "name", None) for k in path]
            name = getattr(path[-1], "key", None)
            if "mu" in attrs or "nu" in attrs:
                out.append(("mu" if "mu" in attrs else "nu", name, leaf))
            elif "count" in attrs:
                out.append(("count", None, leaf))
            else:
                raise ValueError(f"optimizer state leaf at {jax.tree_util.keystr(path)} is not Adam's mu, nu or count.")
        return out

    def checkpoint_tensors(self, state) -> tuple[list, dict, int]:
        """For a checkpoint: (tensors, blocks, count). ``tensors``: (name, shape, layout text, pieces)
        from the arrays' own shards (replica 0 of each block, in the file of the mesh rank whose
        device holds it); ``blocks``: file -> {key: numpy block}, this process's devices only."""
        from ...checkpoint import Piece

        if self.mode is Mode.SINGLE:
            raise ValueError("checkpoints are saved from a sharded run (mode explicit or gspmd), not the single-device reference.")
        rank_of = {d.id: r for r, d in enumerate(self.jax_mesh.devices.flat)}
        named = [(f"params/{k}", v, self.layouts["params"][k]) for k, v in state["params"].items()]
        count = 0
        for kind, name, leaf in self._opt_leaves(state["opt"]):
            if kind == "count":
                count = int(fetch(leaf))
            else:
                named.append((f"opt/{kind}/{name}", leaf, self.layouts["optimizer"][name]))
        tensors, blocks = [], {}
        for name, arr, layout in named:
            pieces: dict = {}
            for dev, index in arr.sharding.devices_indices_map(arr.shape).items():
                start, stop = box = _box(index, arr.shape)
                if box not in pieces:
                    pieces[box] = Piece(f"rank-{rank_of[dev.id]:05d}.safetensors",
                                        f"{name}@{','.join(map(str, start))}", start, stop)
            for shard in arr.addressable_shards:
                piece = pieces[_box(shard.index, arr.shape)]
                if piece.file == f"rank-{rank_of[shard.device.id]:05d}.safetensors":
                    blocks.setdefault(piece.file, {})[piece.key] = np.asarray(shard.data)
            tensors.append((name, tuple(arr.shape), str(layout), list(pieces.values())))
        return tensors, blocks, count

    def restore(self, ckpt, params_only: bool = False) -> dict:
        """A state from a checkpoint saved by any backend, strategy or mesh: each device's block
        is read from the pieces it overlaps. ``params_only``: a fresh optimizer state."""
        shapes = self.model.param_shapes()

        def load(name, shape, sharding):
            return jax.make_array_from_callback(tuple(shape), sharding, lambda index: ckpt.read(
                name, tuple(map(slice, *_box(index, shape))), shape=shape))

        if self.mode is Mode.SINGLE:
            raise ValueError("restore into a sharded run (mode explicit or gspmd).")
        params = {k: load(f"params/{k}", shapes[k], self._sharding(self.layouts["params"][k])) for k in shapes}
        if params_only:
            return {"params": params, "opt": self.init_opt(params)}
        count = ckpt.meta("count")
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(f"{ckpt.path}/manifest.json: field 'count' must be a non-negative int, not {count!r}")
        opt = self.init_opt(params)
        leaves = []
        for kind, name, leaf in self._opt_leaves(opt):
            if kind == "count":
                leaves.append(jax.device_put(np.asarray(count, leaf.dtype), leaf.sharding))
            else:
                leaves.append(load(f"opt/{kind}/{name}", shapes[name], leaf.sharding))
        return {"params": params, "opt": jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(opt), leaves)}

    def params(self, state) -> dict[str, np.ndarray]:
        return {k: fetch(v) for k, v in state["params"].items()}
