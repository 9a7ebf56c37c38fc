"""The PyTorch backend: core plans on torch.distributed with autograd-correct collectives."""

from .collectives import CollectiveLog, run_plan, vary
from .launch import RankFailure, spawn
from .mesh import TorchMesh
from .train import ShardedModel, single_loss_and_grads

__all__ = ["TorchMesh", "CollectiveLog", "run_plan", "vary", "spawn", "RankFailure", "ShardedModel",
           "single_loss_and_grads"]
