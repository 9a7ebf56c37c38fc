"""The PyTorch backend: parlay programs on torch.distributed with autograd-correct collectives."""

from .launch import RankFailure, init_from_env, spawn

__all__ = ["spawn", "init_from_env", "RankFailure"]
