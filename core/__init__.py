"""parlay's layout IR: backend-neutral, imports only the standard library and numpy."""

from .einsum import EinsumPlan, plan_einsum
from .mesh import Mesh
from .plan import Plan, plan_redistribute
from .rules import RuleError, Rules
from .sim import gather, resolve_partial, scatter, simulate, simulate_einsum, simulate_step
from .spec import Layout, P, check_layout
from .steps import (
    AllGather, AllReduce, AllToAll, Kind, LocalSlice, Permute, ReduceScatter, Step, collective_bytes,
    collective_cost,
)

__all__ = [
    "Mesh", "P", "Layout", "check_layout", "Rules", "RuleError",
    "Plan", "plan_redistribute", "EinsumPlan", "plan_einsum",
    "Kind", "AllGather", "ReduceScatter", "AllReduce", "AllToAll", "LocalSlice", "Permute", "Step",
    "collective_bytes", "collective_cost",
    "scatter", "gather", "simulate", "simulate_step", "simulate_einsum", "resolve_partial",
]
