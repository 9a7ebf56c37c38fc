"""Loss and gradients of the neutral model on torch: one process, or one rank of a mesh."""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

from ...core import Layout, Mesh
from ...core.model import GPT, TOKENS
from ...core.optim import OptimizerConfig
from ...core.strategies import Strategy, get_strategy
from .collectives import CollectiveLog
from .explicit import ExplicitOps, Sharded
from .grad_sync import GradSync
from .mesh import TorchMesh
from .ops import TorchOps

__all__ = ["single_loss_and_grads", "ShardedModel", "ShardedModule", "ShardedTrainer", "ReferenceTrainer"]


def _assemble(local: torch.Tensor, layout: Layout, shape) -> np.ndarray:
    """The global array from every rank's block of ``layout`` (a collective: every rank calls it)."""
    import torch.distributed as dist

    pieces = [torch.empty_like(local) for _ in range(layout.mesh.size)]
    dist.all_gather(pieces, local.contiguous())
    full = np.empty(shape, np.float32)
    for r, sl in enumerate(layout.shard_slices(shape)):
        full[sl] = pieces[r].cpu().numpy()
    return full


def single_loss_and_grads(model: GPT, params: Mapping[str, np.ndarray], tokens, targets):
    """The single-process reference: (loss, {name: grad}) as numpy."""
    p = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    loss = model.loss(TorchOps(), p, torch.as_tensor(tokens), torch.as_tensor(targets))
    loss.backward()
    return float(loss.detach()), {k: v.grad.numpy() for k, v in p.items()}


class ShardedModel:
    """The model's parameters as this rank's local shards (storage layouts of the strategy)."""

    def __init__(self, model: GPT, strategy: str | Strategy, mesh: Mesh, *, batch: int | None = None,
                 bucket_bytes: int | None = 25 * 2**20, coalesce: bool = True, device: str | None = None):
        """``bucket_bytes``: data-parallel gradient sums go in buckets of this size that overlap the
        backward pass (``None``: one blocking all-reduce per parameter, as the variance rule says).
        ``coalesce``: parameters gathered for use (FSDP) are gathered one block at a time in one
        collective, and their gradients reduce-scattered likewise. ``device``: where the shards
        live; default CUDA (this rank's current device) under NCCL, else the CPU."""
        self.model, self.strategy, self.mesh = model, get_strategy(strategy), mesh
        self.coalesce = coalesce
        self.strategy.check(mesh, model.config, batch=batch)
        if device is None:
            import torch.distributed as dist
            nccl = dist.is_initialized() and dist.get_backend() == "nccl"
            device = f"cuda:{torch.cuda.current_device()}" if nccl else "cpu"
        self.device = torch.device(device)
        self.tm = TorchMesh(mesh, self.device.type)
        dims, self.shapes = model.param_dims(), model.param_shapes()
        self.layouts = {role: self.strategy.layouts(role, dims, mesh, self.shapes)
                        for role in ("params", "compute", "grads", "optimizer")}
        self.log = CollectiveLog()
        self.grad_sync = (GradSync(self.tm, bucket_bytes=bucket_bytes, log=self.log, grad_layouts=self.layouts["grads"])
                          if bucket_bytes else None)

    def shard(self, params: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
        rank = self.tm.rank
        return {k: torch.tensor(np.ascontiguousarray(v[self.layouts["params"][k].shard_slices(v.shape)[rank]]),
                                device=self.device, requires_grad=True) for k, v in params.items()}

    def loss(self, local_params: Mapping[str, torch.Tensor], tokens, targets, wrap_ops=None) -> torch.Tensor:
        """``wrap_ops(ops)``, if given, wraps the executor (the bisect records every op through it)."""
        mesh, strategy = self.mesh, self.strategy
        ops = ExplicitOps(
            self.tm,
            device=self.device,
            activation=lambda dims: strategy.rules("activations").resolve(dims, mesh, name=f"activation {tuple(dims)}"),
            compute=lambda name, dims: strategy.rules("compute").resolve(dims, mesh, name=name),
            log=self.log,
            grad_sync=self.grad_sync,
        )
        tok_layout = Layout(mesh, strategy.rules("activations").resolve(TOKENS, mesh))
        tokens, targets = np.asarray(tokens), np.asarray(targets)
        sl = tok_layout.shard_slices(tokens.shape)[self.tm.rank]
        wrap = lambda t: Sharded(torch.as_tensor(np.ascontiguousarray(t[sl]), device=self.device), tok_layout, tokens.shape,
                                 frozenset(tok_layout.spec.axes))
        p = {k: Sharded(v, self.layouts["params"][k], self.shapes[k], frozenset(self.layouts["params"][k].spec.axes), k)
             for k, v in local_params.items()}
        if self.coalesce:
            # One gather (and one gradient reduce-scatter) per block, as FSDP's flat parameters.
            dims = self.model.param_dims()
            groups: dict = {}
            for name in p:
                key = ".".join(name.split(".")[:2]) if name.startswith("blocks.") else name.split(".")[0]
                groups.setdefault(key, []).append((name, p[name], dims[name]))
            ops.param_groups = {name: members for members in groups.values() for name, _, _ in members}
        self.last_ops = ops
        loss = self.model.loss(wrap_ops(ops) if wrap_ops is not None else ops, p, wrap(tokens), wrap(targets))
        if loss.varying:
            raise AssertionError(f"the loss still varies over {sorted(loss.varying)}; a reduction is missing")
        return loss.local

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, then wait for the bucketed gradient sums."""
        if self.grad_sync is not None:
            self.grad_sync.sharded.clear()
        loss.backward()
        if self.grad_sync is not None:
            self.grad_sync.finish()

    def grads(self, local_params: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, Layout]]:
        """This rank's gradient of each parameter and the layout it is in (ZeRO-2: sharded)."""
        sharded = self.grad_sync.sharded if self.grad_sync is not None else {}
        return {k: (sharded[k], self.layouts["grads"][k]) if k in sharded else (v.grad, self.layouts["params"][k])
                for k, v in local_params.items()}

    def gather_grads(self, local_params: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
        """Global gradients (for tests): every rank's grad shard, assembled."""
        return {k: _assemble(g, layout, self.shapes[k]) for k, (g, layout) in self.grads(local_params).items()}


def _clip_scale(norm: torch.Tensor, clip: float) -> torch.Tensor:
    # optax.clip_by_global_norm's rule, so torch and JAX trajectories can be compared.
    return torch.where(norm < clip, torch.ones_like(norm), clip / norm)


def _adamw(params, cfg: OptimizerConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay)


def _adamw_step(opt: torch.optim.AdamW, cfg: OptimizerConfig, updates: int) -> int:
    """One AdamW update at the schedule's rate for update ``updates``; returns the new count.
    Where the kernel switch says Triton (by default: CUDA tensors), parlay's fused multi-tensor
    kernel takes the step on the optimizer's own state (so checkpoints see the same state)."""
    from ...triton_kernels import adamw_step, should_use_triton

    params = [p for group in opt.param_groups for p in group["params"] if p.grad is not None]
    lr = cfg.lr_at(updates)
    if params and should_use_triton(None, *params, *(p.grad for p in params)):
        for p in params:
            state = opt.state[p]
            if not state:
                state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
            state["step"] += 1
        with torch.no_grad():
            adamw_step(params, [p.grad for p in params], [opt.state[p]["exp_avg"] for p in params],
                       [opt.state[p]["exp_avg_sq"] for p in params], step=updates + 1, lr=lr, beta1=cfg.beta1,
                       beta2=cfg.beta2, eps=cfg.eps, weight_decay=cfg.weight_decay)
        return updates + 1
    for group in opt.param_groups:
        group["lr"] = lr
    opt.step()
    return updates + 1


class ReferenceTrainer:
    """Single-process AdamW on the neutral model: the reference for the sharded trainer."""

    def __init__(self, model: GPT, params: Mapping[str, np.ndarray], *, optimizer: OptimizerConfig = OptimizerConfig()):
        self.model, self.cfg, self.updates = model, optimizer, 0
        self.params = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
        self.opt = _adamw(list(self.params.values()), optimizer)

    def step(self, tokens, targets) -> float:
        self.opt.zero_grad(set_to_none=True)
        loss = self.model.loss(TorchOps(), self.params, torch.as_tensor(tokens), torch.as_tensor(targets))
        loss.backward()
        with torch.no_grad():
            norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in self.params.values())).float()
            scale = _clip_scale(norm, self.cfg.clip)
            for p in self.params.values():
                p.grad.mul_(scale)
        self.updates = _adamw_step(self.opt, self.cfg, self.updates)
        return float(loss.detach())


class ShardedTrainer:
    """AdamW on this rank's shards. Gradients come out of backward in the parameters' layouts;
    they move to the optimizer layout (a local slice for ZeRO-1/2), torch AdamW updates the
    optimizer-layout shards, and a core plan moves the updated values back to the parameters'
    layout (ZeRO's all-gather)."""

    def __init__(self, sharded: ShardedModel, params: Mapping[str, np.ndarray], *,
                 optimizer: OptimizerConfig = OptimizerConfig()):
        from .collectives import run_plan
        from ...core import plan_redistribute

        self.sm, self.cfg, self.updates = sharded, optimizer, 0
        self._run_plan, self._plan = run_plan, plan_redistribute
        self.module = ShardedModule(sharded, params)
        self.local = dict(self.module.named_parameters())
        rank = sharded.tm.rank
        lay = sharded.layouts
        # Where the optimizer layout is the parameter's own, AdamW steps the parameter in place;
        # elsewhere (ZeRO) it steps a shard of it.
        self.shared = {k for k in params if lay["optimizer"][k] == lay["params"][k]}
        self.master = {k: self.local[k] if k in self.shared else
                       torch.tensor(np.ascontiguousarray(v[lay["optimizer"][k].shard_slices(v.shape)[rank]]),
                                    device=sharded.device, requires_grad=True)
                       for k, v in params.items()}
        self.opt = _adamw(list(self.master.values()), optimizer)

    def _move(self, name: str, x: torch.Tensor, src: str, dst: str) -> torch.Tensor:
        lay = self.sm.layouts
        plan = self._plan(lay[src][name], lay[dst][name], self.sm.shapes[name], itemsize=x.element_size())
        return self._run_plan(plan, x, self.sm.tm, self.sm.log)

    def step(self, tokens, targets) -> float:
        import torch.distributed as dist

        for p in self.local.values():
            p.grad = None
        self.sm.log.entries.clear()  # the collectives of this step only (a long run would grow it)
        loss = self.module(tokens, targets)
        self.sm.backward(loss)
        mesh, lay = self.sm.mesh, self.sm.layouts
        with torch.no_grad():
            # The global norm counts each element once: a replicated shard is divided by its copies.
            sq = torch.zeros((), dtype=torch.float64, device=self.sm.device)
            grads = self.sm.grads(self.local)
            for k, m in self.master.items():
                g, layout = grads[k]
                if k not in self.shared:
                    src = "grads" if layout == lay["grads"][k] and layout != lay["params"][k] else "params"
                    m.grad = self._move(k, g, src, "optimizer").clone()
                copies = mesh.size // int(np.prod([lay["optimizer"][k].shard_count(d) for d in range(m.ndim)]))
                sq += torch.dot(m.grad.reshape(-1), m.grad.reshape(-1)).double() / copies
            dist.all_reduce(sq)
            scale = _clip_scale(torch.sqrt(sq).float(), self.cfg.clip)
            for m in self.master.values():
                m.grad.mul_(scale)
        self.updates = _adamw_step(self.opt, self.cfg, self.updates)
        with torch.no_grad():
            for k, m in self.master.items():
                if k not in self.shared:
                    self.local[k].copy_(self._move(k, m.detach(), "optimizer", "params"))
        return float(loss.detach())

    # -- checkpoints: each rank writes the blocks it is the first holder of, reads what it needs ----
    def _named(self):
        """(checkpoint name, this rank's tensor, layout) of every parameter and AdamW moment."""
        lay = self.sm.layouts
        out = [(f"params/{k}", v.detach(), lay["params"][k]) for k, v in self.local.items()]
        for k, m in self.master.items():
            state = self.opt.state.get(m, {})
            for kind, key in (("mu", "exp_avg"), ("nu", "exp_avg_sq")):
                out.append((f"opt/{kind}/{k}", state.get(key, torch.zeros_like(m)).detach(), lay["optimizer"][k]))
        return out

    def checkpoint_tensors(self) -> tuple[list, dict, int]:
        """(tensors, blocks, count) as ``parlay.checkpoint`` wants them; ``blocks`` holds this rank's
        file only (every rank computes the same ``tensors``, from the layouts alone)."""
        from ...checkpoint import owned_blocks, pieces_of

        rank, tensors, mine = self.sm.tm.rank, [], {}
        for name, value, layout in self._named():
            shape = self.sm.shapes[name.rsplit("/", 1)[1]]
            tensors.append((name, tuple(shape), str(layout), pieces_of(name, layout, shape)))
            for piece in owned_blocks(name, layout, shape, rank):
                mine[piece.key] = value.cpu().numpy()
        return tensors, ({f"rank-{rank:05d}.safetensors": mine} if mine else {}), self.updates

    def restore(self, ckpt, params_only: bool = False) -> None:
        """Parameters, AdamW moments and the update count from a checkpoint of any backend,
        strategy or mesh; this rank reads only its blocks. ``params_only``: a fresh optimizer."""
        rank, lay = self.sm.tm.rank, self.sm.layouts
        count = 0 if params_only else ckpt.meta("count")
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(f"{ckpt.path}/manifest.json: field 'count' must be a non-negative int, not {count!r}")

        def block(name, layout, shape):
            region = layout.shard_slices(tuple(shape))[rank]
            return torch.from_numpy(ckpt.read(name, region, shape=shape)).to(self.sm.device)

        with torch.no_grad():
            for k, p in self.local.items():
                p.copy_(block(f"params/{k}", lay["params"][k], self.sm.shapes[k]))
            for k, m in self.master.items():
                shape, layout = self.sm.shapes[k], lay["optimizer"][k]
                if k not in self.shared:
                    m.copy_(block(f"params/{k}", layout, shape))
                if params_only:
                    continue
                self.opt.state[m] = {"step": torch.tensor(float(count)),
                                     "exp_avg": block(f"opt/mu/{k}", layout, shape),
                                     "exp_avg_sq": block(f"opt/nu/{k}", layout, shape)}
        self.updates = count

    def eval_loss(self, tokens, targets) -> float:
        """The loss alone, no gradients (held-out evaluation)."""
        with torch.no_grad():
            return float(self.module(tokens, targets))

    def gather_params(self) -> dict[str, np.ndarray]:
        return {k: _assemble(v.detach(), self.sm.layouts["params"][k], self.sm.shapes[k]) for k, v in self.local.items()}


class ShardedModule(torch.nn.Module):
    """The model as a ``torch.nn.Module`` whose parameters are this rank's shards, named as in the
    neutral parameter tree (``blocks.0.attn.wq``): ``module(tokens, targets)`` is the loss."""

    def __init__(self, sharded: ShardedModel, params: Mapping[str, np.ndarray]):
        super().__init__()
        self.sharded = sharded
        for name, tensor in sharded.shard(params).items():
            *path, leaf = name.split(".")
            module = self
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, torch.nn.Module())
                module = getattr(module, part)
            module.register_parameter(leaf, torch.nn.Parameter(tensor.detach()))

    def forward(self, tokens, targets) -> torch.Tensor:
        return self.sharded.loss(dict(self.named_parameters()), tokens, targets)
