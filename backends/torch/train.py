"""Loss and gradients of the neutral model on torch: one process, or one rank of a mesh."""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

from ...core import Layout, Mesh
from ...core.model import GPT, TOKENS
from ...core.strategies import Strategy, get_strategy
from .collectives import CollectiveLog
from .explicit import ExplicitOps, Sharded
from .mesh import TorchMesh
from .ops import TorchOps

__all__ = ["single_loss_and_grads", "ShardedModel"]


def single_loss_and_grads(model: GPT, params: Mapping[str, np.ndarray], tokens, targets):
    """The single-process reference: (loss, {name: grad}) as numpy."""
    p = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    loss = model.loss(TorchOps(), p, torch.as_tensor(tokens), torch.as_tensor(targets))
    loss.backward()
    return float(loss.detach()), {k: v.grad.numpy() for k, v in p.items()}


class ShardedModel:
    """The model's parameters as this rank's local shards (storage layouts of the strategy)."""

    def __init__(self, model: GPT, strategy: str | Strategy, mesh: Mesh, *, batch: int | None = None):
        self.model, self.strategy, self.mesh = model, get_strategy(strategy), mesh
        self.strategy.check(mesh, model.config, batch=batch)
        self.tm = TorchMesh(mesh)
        dims, self.shapes = model.param_dims(), model.param_shapes()
        self.layouts = {role: self.strategy.layouts(role, dims, mesh, self.shapes)
                        for role in ("params", "compute", "grads", "optimizer")}
        self.log = CollectiveLog()

    def shard(self, params: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
        rank = self.tm.rank
        return {k: torch.tensor(np.ascontiguousarray(v[self.layouts["params"][k].shard_slices(v.shape)[rank]]),
                                requires_grad=True) for k, v in params.items()}

    def loss(self, local_params: Mapping[str, torch.Tensor], tokens, targets) -> torch.Tensor:
        mesh, strategy = self.mesh, self.strategy
        ops = ExplicitOps(
            self.tm,
            activation=lambda dims: strategy.rules("activations").resolve(dims, mesh, name=f"activation {tuple(dims)}"),
            compute=lambda name, dims: strategy.rules("compute").resolve(dims, mesh, name=name),
            log=self.log,
        )
        tok_layout = Layout(mesh, strategy.rules("activations").resolve(TOKENS, mesh))
        tokens, targets = np.asarray(tokens), np.asarray(targets)
        sl = tok_layout.shard_slices(tokens.shape)[self.tm.rank]
        wrap = lambda t: Sharded(torch.as_tensor(np.ascontiguousarray(t[sl])), tok_layout, tokens.shape,
                                 frozenset(tok_layout.spec.axes))
        p = {k: Sharded(v, self.layouts["params"][k], self.shapes[k], frozenset(self.layouts["params"][k].spec.axes))
             for k, v in local_params.items()}
        loss = self.model.loss(ops, p, wrap(tokens), wrap(targets))
        if loss.varying:
            raise AssertionError(f"the loss still varies over {sorted(loss.varying)}; a reduction is missing")
        return loss.local

    def gather_grads(self, local_params: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
        """Global gradients (for tests): every rank's grad shard, assembled."""
        import torch.distributed as dist

        out = {}
        for k, v in local_params.items():
            pieces = [torch.empty_like(v.grad) for _ in range(self.mesh.size)]
            dist.all_gather(pieces, v.grad.contiguous())
            layout = self.layouts["params"][k]
            full = np.empty(self.shapes[k], np.float32)
            for r, sl in enumerate(layout.shard_slices(self.shapes[k])):
                full[sl] = pieces[r].numpy()
            out[k] = full
        return out
