"""The sharded executor, op by op, on the numpy simulator: for random meshes and random layouts
of the inputs, each op's output (assembled from the ranks' blocks) and the gradients of its
inputs equal the same op on whole arrays. fp32, fresh random inputs; sums in another order:
values to 1e-5 of their size."""

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from layout_strategies import layouts, meshes
from parlay import Layout, P, gather, scatter
from parlay.backends.numpy import autodiff as ad
from parlay.backends.numpy.comm import NumpyComm
from parlay.backends.numpy.ops import NumpyLocal, PerRank
from parlay.core.executor import Sharded, ShardedOps
from parlay.core.ops import DenseOps, DropoutKey

ATOL = 1e-5


def _run_sharded(fn, arrays, layouts_, mesh, *, training=True):
    comm = NumpyComm(mesh)
    leaves, values = [], []
    for a, layout in zip(arrays, layouts_):
        if a.dtype.kind == "f":
            blocks = [ad.Var(b) for b in scatter(a, layout, rng=1)]
            leaves.append(blocks)
        else:
            blocks = scatter(a, layout)
            leaves.append(None)
        values.append(Sharded(PerRank(blocks), layout, a.shape, frozenset(layout.spec.axes) | set(layout.partial)))
    ops = ShardedOps(comm, activation=lambda dims, shape: Layout(mesh, P()), compute=None, training=training,
                     rng=DropoutKey(3, 7))
    out = fn(ops, *values)
    loss = _invariant_loss(ops, out, mesh)
    flat = [v for blocks in leaves if blocks is not None for v in blocks]
    grads = ad.grad(loss.values, flat)
    out_value = gather([np.asarray(ad.value(v)) for v in out.local.values], out.layout)
    gathered, i = [], 0
    for blocks, layout in zip(leaves, layouts_):
        if blocks is None:
            continue
        g = grads[i:i + len(blocks)]
        i += len(blocks)
        gathered.append(gather([np.zeros(np.shape(ad.value(b)), np.float32) if x is None else x for b, x in zip(blocks, g)],
                               layout.replace(partial=())))
    return out_value, gathered


def _invariant_loss(ops, out: Sharded, mesh):
    """sum(out * weight) with each element counted once, the same on every rank: every rank sums
    its block's share (1/copies of a replicated block, each addend of a pending sum), then a sum
    over every axis. ``out`` first varies over every axis, so each rank's gradient is its
    contribution (the convention the executor's transposes follow)."""
    weight = np.random.default_rng(5).standard_normal(out.shape).astype(np.float32)
    out = ops._vary_to(out, frozenset(mesh.axis_names))
    blocks = scatter(weight, out.layout.replace(partial=()))
    distinct = int(np.prod([out.layout.shard_count(d) for d in range(len(out.shape))]))
    distinct *= mesh.group_size(out.layout.partial)
    share = np.float32(distinct / mesh.size)
    local = PerRank(ad.sum(ad.reshape(o * w, (-1,)), 0) * share for o, w in zip(out.local.values, blocks))
    axes = tuple(a for a in mesh.axis_names if mesh.axis_size(a) > 1)
    return ops.comm.psum(local, axes) if axes else local


def _run_dense(fn, arrays, *, training=True):
    ops = DenseOps(NumpyLocal(), training=training, rng=DropoutKey(3, 7))
    vars_ = [ad.Var(a) if a.dtype.kind == "f" else a for a in arrays]
    out = fn(ops, *vars_)
    weight = np.random.default_rng(5).standard_normal(out.shape).astype(np.float32)
    leaves = [v for v in vars_ if isinstance(v, ad.Var)]
    loss = ad.sum(ad.reshape(out * weight, (-1,)), 0)
    return np.asarray(ad.value(out)), ad.grad([loss], leaves)


def _close(a, b):
    return np.allclose(a, b, rtol=0, atol=ATOL * max(1.0, float(np.abs(b).max())))


# (name, fn, input shapes and dtypes, whether an input may be partial)
OPS = [
    ("softmax", lambda o, x: o.softmax(x, 1), [(4, 8, 2)]),
    ("softmax-last", lambda o, x: o.softmax(x, -1), [(4, 8)]),
    ("sum", lambda o, x: o.sum(x, 1), [(4, 8, 2)]),
    ("mean", lambda o, x: o.mean(x, 0), [(8, 4)]),
    ("relu", lambda o, x: o.relu(x), [(4, 8)]),
    ("tanh", lambda o, x: o.tanh(x), [(4, 8)]),
    ("gelu*silu", lambda o, x, y: o.mul(o.gelu(x), o.silu(y)), [(4, 8), (4, 8)]),
    ("add", lambda o, x, y: o.add(x, y), [(4, 8), (4, 8)]),
    ("add_bias", lambda o, x, b: o.add_bias(x, b), [(4, 2, 8), (2, 8)]),
    ("rms_norm", lambda o, x, s: o.rms_norm(x, s, 1e-5), [(4, 2, 8), (8,)]),
    ("layer_norm", lambda o, x, s, b: o.layer_norm(x, s, b, 1e-5), [(4, 2, 8), (8,), (8,)]),
    ("rearrange-split", lambda o, x: o.rearrange(x, "b (h d) -> b h d", h=4), [(4, 16)]),
    ("rearrange-merge", lambda o, x: o.rearrange(x, "b h w c -> b (h w) c"), [(4, 4, 2, 2)]),
    ("rearrange-move", lambda o, x: o.rearrange(x, "b s (h d) -> b h s d", h=2), [(2, 4, 8)]),
    ("dropout", lambda o, x: o.dropout(x, 0.3, key="k"), [(8, 4, 4)]),
    ("attention", lambda o, q, k, v: o.attention(q, k, v, causal=True), [(2, 4, 4, 2), (2, 4, 2, 2), (2, 4, 2, 2)]),
    ("attention-bidirectional", lambda o, q, k, v: o.attention(q, k, v, causal=False), [(2, 4, 2, 2)] * 3),
    ("einsum", lambda o, x, w: o.einsum("bsf,fe->bse", x, w), [(4, 2, 8), (8, 4)]),
    ("scale", lambda o, x: o.scale(x, -0.5), [(4, 8)]),
    ("rotary", lambda o, x: o.rotary(x, *(o.constant(t) for t in _tables(4, 4))), [(2, 4, 2, 4)]),
    ("constant*x", lambda o, x: o.mul(x, o.constant(np.linspace(-1, 1, 32, dtype=np.float32).reshape(4, 8))),
     [(4, 8)]),
]


def _tables(seq, head_dim):
    from parlay.core.models.gpt import rotary_tables

    return rotary_tables(seq, head_dim, 100.0)


@pytest.mark.parametrize("name", [n for n, _, _ in OPS])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(data=st.data())
def test_op_on_blocks_equals_the_op_on_whole_arrays(name, data):
    _, fn, shapes = next(op for op in OPS if op[0] == name)
    mesh = data.draw(meshes(max_ranks=8))
    lays = [data.draw(layouts(mesh, len(s), partial=True)) for s in shapes]
    assume(not any(_fails(l, s) for l, s in zip(lays, shapes)))
    rng = np.random.default_rng(data.draw(st.integers(0, 99)))
    arrays = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    try:
        out, grads = _run_sharded(fn, arrays, lays, mesh)
    except ValueError as e:
        assert "kv heads are split like the query heads" in str(e)  # the one layout attention refuses
        assume(False)
    ref, ref_grads = _run_dense(fn, arrays)
    assert _close(out, ref), f"{name}: value on {[str(l) for l in lays]}"
    for g, r in zip(grads, ref_grads):
        assert _close(g, r), f"{name}: gradient on {[str(l) for l in lays]}"


@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_embedding_and_cross_entropy_with_sharded_vocabularies(data):
    """Ids of any leading shape; the table's and the logits' vocab dims on random axes."""
    mesh = data.draw(meshes(max_ranks=8))
    table_l = data.draw(layouts(mesh, 2, partial=False))
    lead = data.draw(st.sampled_from([(8,), (4, 2)]))
    tok_l = data.draw(layouts(mesh, len(lead), partial=False))
    logit_l = data.draw(layouts(mesh, len(lead) + 1, partial=True))
    assume(not (_fails(table_l, (16, 4)) or _fails(tok_l, lead) or _fails(logit_l, lead + (16,))))
    rng = np.random.default_rng(data.draw(st.integers(0, 99)))
    table = rng.standard_normal((16, 4)).astype(np.float32)
    ids = rng.integers(0, 16, lead).astype(np.int32)
    logits = rng.standard_normal(lead + (16,)).astype(np.float32)
    for fn, arrays, lays in [(lambda o, t, i: o.embed(t, i), [table, ids], [table_l, tok_l]),
                             (lambda o, l, i: o.add_bias(o.sum(o.mul(o.relu(l), l), -1), o.cross_entropy(l, i)),
                              [logits, ids], [logit_l, tok_l])]:
        out, grads = _run_sharded(fn, arrays, lays, mesh)
        ref, ref_grads = _run_dense(fn, arrays)
        assert _close(out, ref)
        assert all(_close(g, r) for g, r in zip(grads, ref_grads))


def test_dropout_bits_are_the_same_on_every_layout_and_off_in_evaluation():
    from parlay import Mesh

    x = np.ones((8, 4, 8), np.float32)
    ref, _ = _run_dense(lambda o, x: o.dropout(x, 0.25, key="blocks.0.attn"), [x])
    assert 0.15 < (ref == 0).mean() < 0.35 and np.allclose(ref[ref != 0], 1 / 0.75)
    mesh = Mesh(dp=2, tp=2, sp=2)
    for spec in [P("dp", "tp", "sp"), P(("tp", "dp"), None, "sp"), P(None, None, ("sp", "dp", "tp"))]:
        out, _ = _run_sharded(lambda o, x: o.dropout(x, 0.25, key="blocks.0.attn"), [x], [Layout(mesh, spec)], mesh)
        assert np.array_equal(out, ref), spec
    other, _ = _run_dense(lambda o, x: o.dropout(x, 0.25, key="blocks.1.attn"), [x])
    assert not np.array_equal(other, ref)  # another key, other bits
    off, _ = _run_dense(lambda o, x: o.dropout(x, 0.25, key="blocks.0.attn"), [x], training=False)
    assert np.array_equal(off, x)



def test_dropout_is_keyed_by_every_bit_of_the_step():
    """Step 2**32 + t has its own mask, not step t's (once: the step was cut to its low 32 bits);
    a traced step's two words (``step_words``, JAX's argument) give the int's mask."""
    from parlay.core.ops import dropout_keep

    coords = [np.arange(4096, dtype=np.int32)]
    mask = {t: dropout_keep(coords, 0.5, "k", DropoutKey(3, t)) for t in (5, 2**31 + 5, 2**32 + 5, 2**63 + 5)}
    assert len({m.tobytes() for m in mask.values()}) == len(mask)
    from parlay.core.ops import step_words

    for t, m in mask.items():
        assert np.array_equal(dropout_keep(coords, 0.5, "k", DropoutKey(3, step_words(t))), m), t
    with pytest.raises(ValueError, match=r"step -1 is outside \[0, 2\*\*64\); a step counts updates from 0"):
        DropoutKey(3, -1)

def _fails(layout, shape) -> bool:
    try:
        layout.check(shape)
        return False
    except ValueError:
        return True
