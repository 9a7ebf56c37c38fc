"""Fake CPU devices for JAX, set before JAX starts (this module does not import JAX)."""

from __future__ import annotations

import os

__all__ = ["use_host_devices"]

_FLAG = "--xla_force_host_platform_device_count"


def use_host_devices(n: int) -> None:
    """Ask XLA for ``n`` host (CPU) devices, unless XLA_FLAGS already sets a count. Has effect only
    before JAX initialises its backends."""
    if _FLAG not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {_FLAG}={n}").strip()
