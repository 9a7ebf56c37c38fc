"""The Triton kernels on the CPU, in Triton's interpreter.

parlay's kernels read ``TRITON_INTERPRET`` at each launch (parlay/triton_kernels/_launch.py), so it
is set per test here and undone after it: nothing else in the pytest process sees it. Spawned
gloo ranks inherit it while the test that spawns them runs.
"""

import os
import sys

import pytest

# kernel_workers.py must import by name here and in spawned ranks (spawn copies sys.path).
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def triton_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("PARLAY_KERNELS", raising=False)
