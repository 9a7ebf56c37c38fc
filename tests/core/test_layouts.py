import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from layout_strategies import layouts, meshes
from parlay import Layout, Mesh, P, scatter
from parlay.core.layouts import (
    attention_layout, bias_layout, embed_layouts, loss_targets_layout, parse_rearrange, rearrange_layouts,
    reduce_layout, rotary_layouts, vector_layout,
)

M = Mesh(dp=2, tp=2, sp=2)


def test_vector_follows_the_last_dim():
    assert vector_layout(Layout(M, P("dp", None, "tp")), 3) == Layout(M, P("tp"))
    assert vector_layout(Layout(M, P("dp")), 3) == Layout(M, P())


def test_bias_follows_the_trailing_dims_and_is_never_partial():
    assert bias_layout(Layout(M, P("dp", None, "tp")), 3, 1) == Layout(M, P("tp"))
    assert bias_layout(Layout(M, P("dp", "tp", None)), 3, 2) == Layout(M, P("tp", None))  # the (S, E) table
    assert bias_layout(Layout(M, P("dp", None, "tp", None)), 4, 2) == Layout(M, P("tp"))  # a (H, D) bias
    assert bias_layout(Layout(M, P("dp"), partial="tp"), 3, 1) == Layout(M, P())


def test_rotary_keeps_head_dim_whole_and_splits_tables_like_seq():
    x, table = rotary_layouts(Layout(M, P("dp", "sp", "tp", None)))
    assert x == Layout(M, P("dp", "sp", "tp")) and table == Layout(M, P("sp"))
    x, _ = rotary_layouts(Layout(M, P(None, None, None, "tp")))
    assert x == Layout(M, P())


def test_attention_keeps_a_split_sequence_for_the_ring_and_needs_head_dim_whole():
    # a split sequence stays split: ring attention over its axes (core/ring.py)
    assert attention_layout(Layout(M, P("dp", "sp", "tp"))) == Layout(M, P("dp", "sp", "tp"))
    assert attention_layout(Layout(M, P("dp", None, None, "tp"))) == Layout(M, P("dp"))


def test_vocab_parallel_embedding_is_partial():
    target, out = embed_layouts(Layout(M, P("tp", None)), Layout(M, P("dp")))
    assert target == Layout(M, P("tp")) and out == Layout(M, P("dp"), partial="tp")
    # The table may not use the tokens' axes: FSDP's dp-sharded table is gathered over dp.
    target, out = embed_layouts(Layout(M, P(None, "dp")), Layout(M, P("dp")))
    assert target == Layout(M, P()) and out == Layout(M, P("dp"))


def test_loss_targets_follow_the_logits():
    assert loss_targets_layout(Layout(M, P("dp", "sp", "tp"))) == Layout(M, P("dp", "sp"))


def test_reduce_makes_the_summed_dim_s_axes_pending():
    assert reduce_layout(Layout(M, P("dp", "tp")), 2, 1) == Layout(M, P("dp"), partial="tp")
    assert reduce_layout(Layout(M, P(None, ("dp", "tp")), partial="sp"), 2, 1) == Layout(M, P(), partial=("dp", "tp", "sp"))


@pytest.mark.parametrize("pattern, shape, sizes, spec, target, out", [
    ("b (h d) -> b h d", (8, 32), dict(h=8), P("dp", "tp"), P("dp", "tp"), P("dp", "tp")),  # tp | h: splits h
    ("b h d -> b (h d)", (8, 8, 4), {}, P("dp", "tp"), P("dp", "tp"), P("dp", "tp")),  # merged over h's axes
    ("b h d -> b (h d)", (8, 8, 4), {}, P("dp", None, "tp"), P("dp"), P("dp")),  # d minor: gathered first
    ("b h w c -> b (h w) c", (8, 4, 4, 3), {}, P("dp", "tp"), P("dp", "tp"), P("dp", "tp")),  # h split to 1 each
    ("b h w c -> b (h w) c", (8, 4, 4, 3), {}, P(None, "dp", "tp"), P(None, "dp"), P(None, "dp")),
    ("b s h -> s b h", (4, 8, 2), {}, P("dp", "tp"), P("dp", "tp"), P("tp", "dp")),  # a transpose moves axes along
    ("b (c p) -> b c p", (8, 12), dict(p=4), P(None, "tp"), P(None, None), P()),  # c=3: tp=4 cannot split it
])
def test_rearrange_layouts(pattern, shape, sizes, spec, target, out):
    r = parse_rearrange(pattern, shape, sizes)
    t, o, _ = rearrange_layouts(r, Layout(MESH2, spec))
    assert (t, o) == (Layout(MESH2, target), Layout(MESH2, out))


MESH2 = Mesh(dp=2, tp=4)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(st.data())
def test_rearrange_on_blocks_is_the_global_rearrange(data):
    """First principles: rearranging each rank's block of the target layout (with local sizes)
    gives the blocks of the output layout of the globally rearranged array."""
    import einops

    pattern, shape, sizes = data.draw(st.sampled_from([
        ("b (h d) -> b h d", (8, 24), dict(h=4)), ("b h d -> b (h d)", (8, 4, 6), {}),
        ("b h w c -> b (h w) c", (4, 4, 2, 3), {}), ("b s (h d) -> b h s d", (2, 8, 12), dict(h=4)),
        ("(a b) c -> c (b a)", (12, 4), dict(a=4)), ("b 1 c -> b c", (8, 1, 6), {}),
    ]))
    mesh = data.draw(meshes())
    layout = data.draw(layouts(mesh, len(shape), partial=False))
    try:
        layout.check(shape)
    except ValueError:
        assume(False)
    r = parse_rearrange(pattern, shape, sizes)
    target, out, local = rearrange_layouts(r, layout)
    x = np.arange(np.prod(shape)).reshape(shape)
    blocks = [einops.rearrange(b, pattern, **local) for b in scatter(x, target)]
    assert all((a == b).all() for a, b in zip(blocks, scatter(einops.rearrange(x, pattern, **sizes), out)))


@pytest.mark.parametrize("pattern, shape, sizes, match", [
    ("b h -> b", (2, 3), {}, r"'h' is on one side only; rearrange moves dims"),
    ("b (h d) -> b h d", (2, 12), {}, r"group \(h d\) of size 12 has 2 unknown sizes \(h, d\); give all but one"),
    ("b (h d) -> b h d", (2, 12), dict(h=5), r"group \(h d\) has size 12, not divisible by 5"),
    ("b ... -> b", (2, 3), {}, r"'...' is not supported"),
    ("b h", (2, 3), {}, r"a pattern is 'input dims -> output dims'"),
    ("b h -> h b", (2, 3, 4), {}, r"the input side names 2 dims but the tensor has shape \(2, 3, 4\)"),
])
def test_rearrange_errors(pattern, shape, sizes, match):
    with pytest.raises(ValueError, match=match):
        parse_rearrange(pattern, shape, sizes)
