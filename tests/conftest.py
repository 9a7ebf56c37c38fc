import os

# JAX reads this once, when it first starts: 8 fake CPU devices for the sharding tests.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import sys

# Shared test helpers (layout_strategies.py) import by name under --import-mode=importlib.
sys.path.insert(0, os.path.dirname(__file__))
