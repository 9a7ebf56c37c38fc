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
from .layers import Dim, Init, ParamDecl
from .model import DType, InputDecl, Model, Split
from .strategies import Role, Strategy, get_strategy
from .executor import Fault
from .program import Program, ProgramError, make_program
from .loading import load_model, load_strategy
from .session import get_backend

__all__ = [
    "Mesh", "P", "Layout", "check_layout", "Rules", "RuleError",
    "Plan", "plan_redistribute", "EinsumPlan", "plan_einsum",
    "Kind", "AllGather", "ReduceScatter", "AllReduce", "AllToAll", "LocalSlice", "Permute", "Step",
    "collective_bytes", "collective_cost",
    "scatter", "gather", "simulate", "simulate_step", "simulate_einsum", "resolve_partial",
    "Dim", "Init", "ParamDecl", "DType", "InputDecl", "Model", "Split", "Role", "Strategy", "get_strategy", "Fault",
    "Program", "ProgramError", "make_program", "load_model", "load_strategy", "get_backend",
]
