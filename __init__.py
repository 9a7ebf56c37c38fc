"""parlay: parallel layouts written once, run on PyTorch and JAX, checked against each other.

The public API is the layout IR of ``parlay.core``; the backends live in ``parlay.backends``.
"""

from .core import *  # noqa: F401,F403
from .core import __all__

__version__ = "0.1.0"
