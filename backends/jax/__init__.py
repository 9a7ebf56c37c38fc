"""The JAX backend: parlay layouts lowered to jax.sharding (shard_map and GSPMD execution follow)."""

from .mesh import lower_layout, lower_mesh, lower_spec

__all__ = ["lower_mesh", "lower_spec", "lower_layout"]
