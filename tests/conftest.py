import os

from parlay.backends.jax.env import use_host_devices

# JAX reads this once, when it first starts: 8 fake CPU devices for the sharding tests.
use_host_devices(8)

import sys

# Shared test helpers (layout_strategies.py) import by name under --import-mode=importlib.
sys.path.insert(0, os.path.dirname(__file__))
