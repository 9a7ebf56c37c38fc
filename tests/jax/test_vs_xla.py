"""parlay's redistribution plans never send more bytes than XLA's, costed the same way.

The costing of XLA's optimized HLO lives in ``benchmarks/redistribute_vs_xla.py``; these tests
check that parser on hand-computed cases, then compare on the benchmark's table and on random
pairs.
"""

import importlib.util
import pathlib
import sys

import jax
import pytest

from parlay.core import Kind, Layout, Mesh, P, plan_redistribute

# tests/conftest.py sets XLA_FLAGS to 8 host devices before JAX starts.
assert jax.device_count() >= 8, f"JAX sees {jax.device_count()} devices; tests/conftest.py should give it 8"

_ROOT = pathlib.Path(__file__).parents[2]
_NAME = "parlay_benchmarks_redistribute_vs_xla"


def _load_bench():
    if _NAME in sys.modules:
        return sys.modules[_NAME]
    spec = importlib.util.spec_from_file_location(_NAME, _ROOT / "benchmarks" / "redistribute_vs_xla.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[_NAME] = mod  # dataclasses look their module up while the file runs
    spec.loader.exec_module(mod)
    return mod


bench = _load_bench()

RANDOM_SEED = 20240611
RANDOM_PAIRS = bench.random_pairs(24, RANDOM_SEED)


def _id(pair) -> str:
    return f"{pair.mesh}-{'x'.join(map(str, pair.shape))}-{pair.src}->{pair.dst}".replace(" ", "")


def _layouts(pair):
    return Layout(pair.mesh, pair.src), Layout(pair.mesh, pair.dst)


# -- (a) the HLO parser on hand-computed cases --------------------------------------------------

HAND = [
    # mesh, shape, src, dst, XLA's collectives (opcode, group size, bytes), busiest device's bytes
    pytest.param(Mesh(dp=8), (64, 128), P("dp"), P(None),
                 [("all-gather", 8, 7 * 8 * 128 * 4)], 7 * 8 * 128 * 4, id="gather-dp8"),
    pytest.param(Mesh(dp=8), (64, 128), P(), P("dp"), [], 0, id="slice-dp8"),
    # all-to-all over 8 of the 8x128 shard: 7 of 8 pieces leave
    pytest.param(Mesh(dp=8), (64, 128), P("dp"), P(None, "dp"),
                 [("all-to-all", 8, 7 * (8 * 128 // 8) * 4)], 7 * 128 * 4, id="a2a-dp8"),
    # the order of the flattened axes changes: 6 of 8 ranks send their 8x128 shard once
    pytest.param(Mesh(dp=2, tp=4), (64, 128), P(("dp", "tp")), P(("tp", "dp")),
                 [("collective-permute", 6, 8 * 128 * 4)], 8 * 128 * 4, id="permute-dp2tp4"),
    # the example: permute a 4x4 shard, gather 2 along dim 1, then 2 along dim 0 of 4x8
    pytest.param(Mesh(dp=2, tp=4), (8, 16), P("dp", "tp"), P(None, "dp"),
                 [("collective-permute", 4, 4 * 4 * 4), ("all-gather", 2, 4 * 4 * 4), ("all-gather", 2, 4 * 8 * 4)],
                 4 * 4 * 4 + 4 * 4 * 4 + 4 * 8 * 4, id="issue-example"),
]


@pytest.mark.parametrize("mesh, shape, src, dst, colls, total", HAND)
def test_xla_bytes_hand_checked(mesh, shape, src, dst, colls, total):
    got_total, got = bench.xla_bytes(Layout(mesh, src), Layout(mesh, dst), shape)
    assert got == colls
    assert got_total == total


_SYNTHETIC_HLO = """\
HloModule synthetic, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (p: f32[8,128], x: f32[4]) -> f32[8,128] {
  %p = f32[8,128]{1,0} parameter(0)
  %x = f32[4]{0} parameter(1)
  %ag = f32[16,128]{1,0} all-gather(%p), channel_id=1, replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}, use_global_device_ids=true
  %ags = (f32[16,128]{1,0}, f32[64,128]{1,0}) all-gather-start(%ag), channel_id=2, replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}, use_global_device_ids=true
  %agd = f32[64,128]{1,0} all-gather-done(%ags)
  %rs = f32[8,128]{1,0} reduce-scatter(%agd), channel_id=3, replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add
  %ar = (f32[8,128]{1,0}, f32[4]{0}) all-reduce(%rs, %x), channel_id=4, replica_groups={}, to_apply=%add
  %cps = (f32[8,128]{1,0}, f32[8,128]{1,0}, u32[], u32[]) collective-permute-start(%rs), channel_id=5, source_target_pairs={{0,1},{1,0},{2,2}}
  %cpd = f32[8,128]{1,0} collective-permute-done(%cps)
  %s0 = f32[8,64]{1,0} slice(%cpd), slice={[0:8], [0:64]}
  %s1 = f32[8,64]{1,0} slice(%cpd), slice={[0:8], [64:128]}
  %t = (f32[8,64]{1,0}, /*index=1*/f32[8,64]{1,0}) all-to-all(%s0, /*index=1*/%s1), channel_id=6, replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([2,4]T(1,0)) {'axis_1':(1)2}
  ROOT %a2a = f32[8,128]{1,0} all-to-all(%cpd), channel_id=7, replica_groups=[4,2]<=[2,2,2]T(0,2,1), dimensions={1}
}
"""


def test_parser_on_synthetic_hlo():
    """Forms the CPU backend does not print (async starts, reduce-scatter, tuple all-reduce,
    explicit and empty groups, sub-axis mesh groups)."""
    colls = bench.parse_collectives(_SYNTHETIC_HLO, 8)
    got = [(c.name, c.kind, c.group_size, c.operand_elems) for c in colls]
    assert got == [
        ("ag", Kind.ALL_GATHER, 2, (1024,)),
        ("ags", Kind.ALL_GATHER, 4, (2048,)),
        ("rs", Kind.REDUCE_SCATTER, 8, (8192,)),
        ("ar", Kind.ALL_REDUCE, 8, (1024, 4)),
        ("cps", Kind.PERMUTE, 2, (1024,)),
        ("t", Kind.ALL_TO_ALL, 2, (512, 512)),
        ("a2a", Kind.ALL_TO_ALL, 2, (1024,)),
    ]
    for c in colls:  # the inference from result shapes agrees with the operands' own shapes
        assert sum(c.operand_elems_by_name) == sum(c.operand_elems), c
    bytes_ = {c.name: c.bytes for c in colls}
    assert bytes_ == {
        "ag": 1 * 1024 * 4,
        "ags": 3 * 2048 * 4,
        "rs": 7 * (8192 // 8) * 4,
        "ar": 2 * 7 * (1024 // 8) * 4 + 2 * 7 * 4 * 4 // 8,  # exact: 2(n-1)/n of 4 elements
        "cps": 1024 * 4,
        "t": 1 * 512 * 4,
        "a2a": 1 * 512 * 4,
    }
    assert colls[4].per_device == {0: 4096, 1: 4096}  # {2,2} sends nothing
    others = 4096 + 24576 + 28672 + 7196 + 2048 + 2048
    assert bench.busiest_device_bytes(colls) == others + 4096


_LOOP_HLO = """\
HloModule loops, num_partitions=4

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%inner (q: f32[64]) -> f32[64] {
  %q = f32[64]{0} parameter(0)
  ROOT %ar2 = f32[64]{0} all-reduce(%q), channel_id=2, replica_groups=[1,4]<=[4], to_apply=%add
}

%cond (c: (s32[], f32[64])) -> pred[] {
  %c = (s32[], f32[64]{0}) parameter(0)
  ROOT %lt = pred[] constant(true)
}

%body (t: (s32[], f32[64])) -> (s32[], f32[64]) {
  %t = (s32[], f32[64]{0}) parameter(0)
  %v = f32[64]{0} get-tuple-element(%t), index=1
  %ar1 = f32[64]{0} all-reduce(%v), channel_id=1, replica_groups=[1,4]<=[4], to_apply=%add
  %in = f32[64]{0} call(%ar1), to_apply=%inner
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %o = (s32[], f32[64]{0}) tuple(%i, %in)
}

ENTRY %main (x: f32[64]) -> f32[64] {
  %x = f32[64]{0} parameter(0)
  %z = s32[] constant(0)
  %init = (s32[], f32[64]{0}) tuple(%z, %x)
  %w = (s32[], f32[64]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %r = f32[64]{0} get-tuple-element(%w), index=1
  %once = f32[64]{0} call(%r), to_apply=%inner
  ROOT %ar3 = f32[64]{0} all-reduce(%once), channel_id=3, replica_groups=[1,4]<=[4], to_apply=%add
}
"""


def test_a_loop_body_counts_its_trip_count():
    """A while's body runs its known trip count times; a computation called from the body and
    from the entry runs as often as all its callers together (3 + 1)."""
    trips = {c.name: c.trips for c in bench.parse_collectives(_LOOP_HLO, 4)}
    assert trips == {"ar2": 4, "ar1": 3, "ar3": 1}


# -- (b), (c): parlay never sends more than XLA -------------------------------------------------

def _check(pair):
    src, dst = _layouts(pair)
    plan = plan_redistribute(src, dst, pair.shape, itemsize=4)
    xla_total, xla_colls = bench.xla_bytes(src, dst, pair.shape)
    assert plan.bytes_per_device <= xla_total, (
        f"parlay sends more than XLA on {pair.mesh} shape {pair.shape} {pair.src} -> {pair.dst}: "
        f"parlay {plan.bytes_per_device} B ({'; '.join(map(str, plan.steps))}), "
        f"XLA {xla_total} B ({xla_colls})"
    )


@pytest.mark.parametrize("pair", bench.TABLE, ids=_id)
def test_parlay_le_xla_on_table(pair):
    _check(pair)


@pytest.mark.parametrize("pair", RANDOM_PAIRS, ids=_id)
def test_parlay_le_xla_on_random_pairs(pair):
    _check(pair)


def test_table_covers_the_brief():
    meshes = {p.mesh for p in bench.TABLE}
    assert meshes == set(bench.MESHES)
    assert len(bench.TABLE) >= 24
    assert {len(p.shape) for p in bench.TABLE} == {2, 3}
    assert bench.Pair(Mesh(dp=2, tp=4), (8, 16), P("dp", "tp"), P(None, "dp")) in bench.TABLE


def test_operand_inference_matches_operand_shapes():
    """The parser infers operand sizes from result shapes; the HLO's operands agree."""
    for pair in list(bench.TABLE) + RANDOM_PAIRS:
        src, dst = _layouts(pair)
        for c in bench.parse_collectives(bench.xla_hlo(src, dst, pair.shape), 8):
            assert c.operand_elems_by_name is not None, (pair, c)
            assert sum(c.operand_elems_by_name) == sum(c.operand_elems), (pair, c)
            if c.kind is Kind.ALL_TO_ALL and len(c.operand_elems) > 1:
                assert len(c.operand_elems) == c.group_size, (pair, c)


def test_compare_rows_and_summary():
    rows = bench.compare(bench.TABLE[:3])
    assert [r.pair for r in rows] == list(bench.TABLE[:3])
    line, worse = bench.summarize(rows)
    assert line.startswith("3 pairs:") and not worse
    md = bench.markdown_table(rows)
    assert md.count("\n") == 2 + len(rows) - 1
