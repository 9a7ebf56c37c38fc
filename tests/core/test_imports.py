"""core/ imports only the standard library and numpy."""

import ast
import subprocess
import sys
from pathlib import Path

CORE = Path(__file__).parents[2] / "core"
BLOCKED = ("torch", "jax", "jaxlib", "flax", "optax", "triton", "einops", "safetensors", "rich")


def test_core_modules_import_only_stdlib_and_numpy():
    offenders = []
    for path in sorted(CORE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top != "numpy" and top not in sys.stdlib_module_names:
                    offenders.append(f"{path.name}: {name}")
    assert offenders == []


def test_core_imports_with_frameworks_blocked():
    code = f"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {BLOCKED!r}:
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, Block())
import parlay, parlay.core
from parlay import Mesh, P, Layout, plan_redistribute, scatter, simulate
m = Mesh(dp=2)
plan_redistribute(Layout(m, P('dp')), Layout(m, P()), (4,))
loaded = sorted(m for m in sys.modules if m.split('.')[0] in {BLOCKED!r})
assert not loaded, loaded
print('ok')
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
