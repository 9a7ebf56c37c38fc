"""parlay's redistribution plans against XLA's, in bytes the busiest device sends.

For each pair of layouts, XLA (GSPMD / Shardy on 8 host CPU devices) compiles an identity
function whose input and output shardings are the two layouts; the collectives in the optimized
HLO are costed with parlay's own cost model (``parlay.core.collective_bytes``, ring algorithms),
so the two numbers are like for like. parlay's number is
``plan_redistribute(src, dst, shape, itemsize=4).bytes_per_device``.

    python benchmarks/redistribute_vs_xla.py                 # the fixed table
    python benchmarks/redistribute_vs_xla.py --random 50 --seed 1
    python benchmarks/redistribute_vs_xla.py --markdown      # a GitHub table for the README

Exits with status 1 when parlay sends more than XLA on any pair.
"""

from __future__ import annotations

import os

from parlay.backends.jax.env import use_host_devices

_FLAG = "--xla_force_host_platform_device_count=8"
use_host_devices(8)
if __name__ == "__main__":
    # XLA warns "Involuntary full rematerialization" where it replicates to reshard; the table
    # shows those bytes anyway, so as a script keep stderr quiet unless a log level is chosen.
    # (Read when jaxlib loads, hence here; importers keep their own setting.)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse
import math
import random
import sys
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable, NamedTuple, Sequence

import jax
import numpy as np

from parlay.backends.jax.mesh import lower_layout, lower_mesh
from parlay.backends.jax.hlo import busiest_device_bytes, parse_collectives
from parlay.core import Layout, Mesh, P, plan_redistribute

__all__ = [
    "Pair", "Row", "MESHES", "TABLE", "xla_bytes", "xla_hlo", "parse_collectives", "busiest_device_bytes",
    "random_pairs", "compare", "summarize", "markdown_table", "main",
]

ITEMSIZE = 4  # float32 on both sides

MESHES = (Mesh(dp=8), Mesh(dp=2, tp=4), Mesh(dp=4, tp=2), Mesh(dp=2, tp=2, sp=2))


class Pair(NamedTuple):
    mesh: Mesh
    shape: tuple[int, ...]
    src: P
    dst: P


# -- the fixed table -------------------------------------------------------------------------------

def _table() -> tuple[Pair, ...]:
    m8, m24, m42, m222 = MESHES
    s2, s3 = (64, 128), (16, 32, 64)
    return (
        # Mesh(dp=8)
        Pair(m8, s2, P("dp"), P()),                                      # shard -> replicate
        Pair(m8, s2, P(), P("dp")),                                      # replicate -> shard
        Pair(m8, s2, P("dp"), P(None, "dp")),                            # dim 0 -> dim 1
        Pair(m8, s2, P(None, "dp"), P("dp")),                            # dim 1 -> dim 0
        Pair(m8, s3, P(None, "dp"), P(None, None, "dp")),                # dim 1 -> dim 2, 3-D
        Pair(m8, s3, P("dp"), P()),                                      # shard -> replicate, 3-D
        # Mesh(dp=2, tp=4)
        Pair(m24, (8, 16), P("dp", "tp"), P(None, "dp")),                # the example
        Pair(m24, s2, P("dp", "tp"), P()),                               # shard -> replicate
        Pair(m24, s2, P(), P("dp", "tp")),                               # replicate -> shard
        Pair(m24, s2, P(("dp", "tp")), P(("tp", "dp"))),                 # multi-axis order change
        Pair(m24, s2, P(("dp", "tp")), P()),                             # multi-axis -> replicate
        Pair(m24, s2, P("tp"), P(None, "tp")),                           # dim 0 -> dim 1, same axis
        Pair(m24, s2, P(("dp", "tp")), P("dp", "tp")),                   # move tp dim 0 -> dim 1
        Pair(m24, s2, P("dp", "tp"), P("tp", "dp")),                     # swap two axes
        Pair(m24, s2, P("dp"), P("dp", "tp")),                           # replicate -> shard on tp
        Pair(m24, s3, P("dp", "tp"), P(None, "tp", "dp")),               # 3-D, two axes move
        Pair(m24, s3, P(None, ("dp", "tp")), P(None, ("tp", "dp"))),     # 3-D, order change
        # Mesh(dp=4, tp=2)
        Pair(m42, s2, P("dp", "tp"), P("tp", "dp")),                     # swap two axes
        Pair(m42, s2, P(("dp", "tp")), P(("tp", "dp"))),                 # multi-axis order change
        Pair(m42, s2, P(("dp", "tp"), None), P(None, ("dp", "tp"))),     # multi-axis dim 0 -> dim 1
        Pair(m42, s2, P("dp"), P()),                                     # shard -> replicate
        Pair(m42, s2, P(None, ("tp", "dp")), P("tp", "dp")),             # move dp dim 1 -> dim 0
        Pair(m42, s3, P("dp", "tp"), P(None, "dp", "tp")),               # 3-D shift
        # Mesh(dp=2, tp=2, sp=2)
        Pair(m222, s3, P("dp", "tp", "sp"), P()),                        # shard -> replicate
        Pair(m222, s3, P(), P("dp", "tp", "sp")),                        # replicate -> shard
        Pair(m222, s3, P("dp", "tp", "sp"), P("sp", "dp", "tp")),        # rotate three axes
        Pair(m222, s3, P(("dp", "tp"), "sp"), P(("tp", "dp"), "sp")),    # multi-axis order change
        Pair(m222, s3, P("dp", "tp"), P("tp", "dp")),                    # swap two axes
        Pair(m222, s3, P(("dp", "tp", "sp")), P(None, ("sp", "tp", "dp"))),  # all axes move, reversed
        Pair(m222, s2, P(("dp", "sp"), "tp"), P("dp", ("tp", "sp"))),    # move sp dim 0 -> dim 1
        Pair(m222, s2, P("dp", "tp"), P(("dp", "tp"))),                  # move tp dim 1 -> dim 0
    )


TABLE = _table()


# -- random pairs ----------------------------------------------------------------------------------

def _random_spec(rng: random.Random, mesh: Mesh, ndim: int) -> P:
    dims: list[list[str]] = [[] for _ in range(ndim)]
    axes = list(mesh.axis_names)
    rng.shuffle(axes)  # the order axes land in a dim: random major-to-minor order
    for a in axes:
        d = rng.randrange(ndim + 1)  # ndim: the axis is replicated
        if d < ndim:
            dims[d].append(a)
    return P(*(None if not a else a[0] if len(a) == 1 else tuple(a) for a in dims))


def random_pairs(n: int, seed: int = 0) -> list[Pair]:
    """``n`` random non-partial pairs: a mesh of ``MESHES``, 2 or 3 dims, every dim a multiple of
    8 (so every layout on an 8-device mesh divides it), each axis used at most once per spec."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        mesh = rng.choice(MESHES)
        ndim = rng.choice((2, 3))
        shape = tuple(rng.choice((8, 16, 32, 64)) for _ in range(ndim))
        src, dst = _random_spec(rng, mesh, ndim), _random_spec(rng, mesh, ndim)
        if Layout(mesh, src) == Layout(mesh, dst):
            continue
        out.append(Pair(mesh, shape, src, dst))
    return out


# -- XLA's side ------------------------------------------------------------------------------------

@lru_cache(maxsize=None)
def _jax_mesh(mesh: Mesh):
    return lower_mesh(mesh)


def xla_hlo(src: Layout, dst: Layout, shape: Sequence[int]) -> str:
    """The optimized HLO XLA compiles for an identity from ``src``'s sharding to ``dst``'s."""
    jm = _jax_mesh(src.mesh)
    compiled = jax.jit(
        lambda x: x, in_shardings=lower_layout(src, jm), out_shardings=lower_layout(dst, jm)
    ).lower(jax.ShapeDtypeStruct(tuple(shape), np.float32)).compile()
    return compiled.as_text()


def xla_bytes(src: Layout, dst: Layout, shape: Sequence[int]) -> tuple[int, list[tuple[str, int, int]]]:
    """(bytes the busiest device sends over XLA's whole program, [(kind, group size, bytes)])."""
    colls = parse_collectives(xla_hlo(src, dst, shape), src.mesh.size)
    return busiest_device_bytes(colls), [(c.opcode, c.group_size, c.bytes) for c in colls]


# -- the comparison --------------------------------------------------------------------------------

@dataclass
class Row:
    pair: Pair
    parlay_bytes: int
    xla_bytes: int
    parlay_steps: list[str]
    xla_collectives: list[tuple[str, int, int]]

    @property
    def ratio(self) -> float:
        if self.xla_bytes == 0:
            return 1.0 if self.parlay_bytes == 0 else math.inf
        return self.parlay_bytes / self.xla_bytes

    def cells(self) -> list[str]:
        p = self.pair
        xla = "; ".join(
            (f"{k}({n} pairs)" if k.startswith("collective-permute") else f"{k}(n={n})")
            for k, n, _ in self.xla_collectives
        )
        return [
            repr(p.mesh).removeprefix("Mesh(").removesuffix(")"), "x".join(map(str, p.shape)), str(p.src), str(p.dst),
            str(self.parlay_bytes), str(self.xla_bytes), f"{self.ratio:.2f}",
            "; ".join(self.parlay_steps) or "-", xla or "-",
        ]


COLUMNS = ["mesh", "shape", "src", "dst", "parlay B", "XLA B", "parlay/XLA", "parlay steps", "XLA collectives"]


def compare(pairs: Iterable[Pair]) -> list[Row]:
    rows = []
    for pair in pairs:
        src, dst = Layout(pair.mesh, pair.src), Layout(pair.mesh, pair.dst)
        plan = plan_redistribute(src, dst, pair.shape, itemsize=ITEMSIZE)
        xb, colls = xla_bytes(src, dst, pair.shape)
        rows.append(Row(pair, plan.bytes_per_device, xb, [str(s) for s in plan.steps], colls))
    return rows


def summarize(rows: Sequence[Row]) -> tuple[str, list[Row]]:
    """The summary line, and the rows where parlay sends more than XLA."""
    less = sum(r.parlay_bytes < r.xla_bytes for r in rows)
    equal = sum(r.parlay_bytes == r.xla_bytes for r in rows)
    worse = [r for r in rows if r.parlay_bytes > r.xla_bytes]
    both = [r.ratio for r in rows if r.parlay_bytes and r.xla_bytes]
    geo = math.exp(sum(map(math.log, both)) / len(both)) if both else float("nan")
    line = (
        f"{len(rows)} pairs: parlay < XLA on {less}, == on {equal}, > on {len(worse)}; "
        f"geometric-mean parlay/XLA {geo:.3f} (over the {len(both)} pairs where both send bytes)"
    )
    return line, worse


def markdown_table(rows: Sequence[Row]) -> str:
    esc = lambda s: s.replace("|", "\\|")
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    lines += ["| " + " | ".join(esc(c) for c in r.cells()) + " |" for r in rows]
    return "\n".join(lines)


def _rich_table(rows: Sequence[Row]):
    from rich.table import Table
    from rich.text import Text

    table = Table(title="parlay vs XLA: bytes the busiest device sends (float32, 8 CPU devices)")
    for c in COLUMNS:
        table.add_column(c, justify="right" if c in ("parlay B", "XLA B", "parlay/XLA") else "left",
                         overflow="fold")
    for r in rows:
        cells = r.cells()
        style = "red" if r.parlay_bytes > r.xla_bytes else ("green" if r.parlay_bytes < r.xla_bytes else None)
        table.add_row(*(Text(c) for c in cells), style=style)  # Text: "[dp]" is not markup
    return table


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--random", type=int, default=0, metavar="N", help="add N random non-partial pairs")
    ap.add_argument("--seed", type=int, default=0, help="seed for --random")
    ap.add_argument("--markdown", action="store_true", help="print a GitHub markdown table")
    args = ap.parse_args(argv)
    if len(jax.devices()) < 8:
        print(f"needs 8 devices, JAX sees {len(jax.devices())}; set XLA_FLAGS={_FLAG}", file=sys.stderr)
        return 2

    pairs = list(TABLE) + random_pairs(args.random, args.seed)
    rows = compare(pairs)
    if args.markdown:
        print(markdown_table(rows))
    else:
        from rich.console import Console

        Console(width=max(200, Console().width)).print(_rich_table(rows))
    line, worse = summarize(rows)
    print(line)
    if worse:
        print("parlay sends more than XLA on:")
        for r in worse:
            p = r.pair
            print(f"  {p.mesh} shape {p.shape} {p.src} -> {p.dst}: parlay {r.parlay_bytes} B "
                  f"({'; '.join(r.parlay_steps)}), XLA {r.xla_bytes} B ({r.xla_collectives})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
