from parlay import Layout, Mesh, P
from parlay.core.operand_layouts import (
    attention_layout, bias_layout, embed_layouts, loss_targets_layout, rotary_layouts, vector_layout,
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


def test_attention_needs_whole_sequence():
    assert attention_layout(Layout(M, P("dp", "sp", "tp"))) == Layout(M, P("dp", None, "tp"))


def test_vocab_parallel_embedding_is_partial():
    target, out = embed_layouts(Layout(M, P("tp", None)), Layout(M, P("dp")))
    assert target == Layout(M, P("tp")) and out == Layout(M, P("dp"), partial="tp")
    # The table may not use the tokens' axes: FSDP's dp-sharded table is gathered over dp.
    target, out = embed_layouts(Layout(M, P(None, "dp")), Layout(M, P("dp")))
    assert target == Layout(M, P()) and out == Layout(M, P("dp"))


def test_loss_targets_follow_the_logits():
    assert loss_targets_layout(Layout(M, P("dp", "sp", "tp"))) == Layout(M, P("dp", "sp"))
