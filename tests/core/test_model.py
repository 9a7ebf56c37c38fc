import numpy as np
import pytest

from parlay import Mesh
from parlay.core.model import GPT, PRESETS, GPTConfig, Init, ParamDecl, Positions, init_params
from parlay.core.strategies import STRATEGIES, get_strategy


def test_decls_and_shapes():
    model = GPT(PRESETS["tiny-gqa"])
    shapes = model.param_shapes()
    c = model.config
    assert shapes["embed.table"] == (c.vocab, c.embed)
    assert shapes["blocks.0.attn.wq"] == (c.embed, c.heads, c.head_dim)
    assert shapes["blocks.0.attn.wk"] == (c.embed, c.kv_heads, c.head_dim)
    assert shapes["blocks.1.mlp.w_gate"] == (c.embed, c.mlp)
    assert model.param_dims()["blocks.1.attn.wo"] == ("heads", "kv", "embed")
    assert "blocks.0.norm1.bias" not in shapes  # RMSNorm has no bias
    assert "blocks.0.norm1.bias" in GPT(PRESETS["tiny-gpt2"]).param_shapes()
    assert "blocks.0.mlp.w_gate" not in GPT(PRESETS["tiny-gpt2"]).param_shapes()


def test_hugging_face_gpt2_options():
    """Learned positions, biases and a tied LM head: the params they add and remove."""
    model = GPT(PRESETS["tiny-gpt2-hf"])
    shapes, dims, c = model.param_shapes(), model.param_dims(), model.config
    assert shapes["pos_embed.table"] == (c.seq, c.embed) and dims["pos_embed.table"] == ("seq", "embed")
    assert "lm_head.w" not in shapes  # the head is embed.table
    assert dims["blocks.0.attn.bq"] == ("heads", "kv") and dims["blocks.0.attn.bk"] == ("kv_heads", "kv")
    assert dims["blocks.1.attn.bo"] == ("embed",) and dims["blocks.1.mlp.b_in"] == ("mlp",)
    assert "blocks.0.mlp.b_gate" not in shapes  # GELU: no gate
    assert "blocks.0.mlp.b_gate" in GPT(PRESETS["tiny-gqa"].with_(bias=True)).param_shapes()
    assert (model.init(0)["blocks.0.attn.bo"] == 0).all()
    # Learned positions need no even head_dim.
    assert GPTConfig(embed=24, heads=8, positions=Positions.LEARNED).head_dim == 3


def test_gpt2_small_size():
    n = sum(int(np.prod(s)) for s in GPT(PRESETS["gpt2-small"]).param_shapes().values())
    # 124M of GPT-2 small plus an untied lm head (38.6M) and the padded vocab; no position table.
    assert 162e6 < n < 164e6


def test_init_is_deterministic_per_name():
    model = GPT(PRESETS["tiny"])
    a, b = model.init(0), model.init(0)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    c = model.init(1)
    assert not np.array_equal(a["embed.table"], c["embed.table"])
    # A parameter's values do not depend on which other parameters exist.
    only = init_params((ParamDecl("embed.table", (256, 64), ("vocab", "embed")),), 0)
    assert np.array_equal(only["embed.table"], a["embed.table"])
    assert a["blocks.0.norm1.scale"].dtype == np.float32 and (a["blocks.0.norm1.scale"] == 1).all()
    assert abs(a["blocks.0.attn.wq"].std() - 0.02) < 0.002


@pytest.mark.parametrize("kwargs, match", [
    (dict(embed=60, heads=8), r"embed=60 is not divisible by heads=8"),
    (dict(heads=8, kv_heads=3), r"heads=8 is not divisible by kv_heads=3"),
    (dict(embed=24, heads=8), r"head_dim=3 \(embed / heads\) must be even"),
    (dict(layers=0), r"layers=0 must be a positive int"),
    (dict(positions="learned"), r"positions='learned' must be a Positions \(Positions.ROTARY, Positions.LEARNED\)"),
    (dict(bias=1), r"bias=1 must be a bool"),
])
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**kwargs)
    with pytest.raises(ValueError, match=r"GPTConfig has no field 'hidden'"):
        PRESETS["tiny"].with_(hidden=3)
    with pytest.raises(ValueError, match=r"shape \(2, 3\) has 2 dims but 1 logical names"):
        ParamDecl("w", (2, 3), ("embed",), Init.NORMAL)


def test_every_strategy_resolves_for_the_tiny_model():
    model = GPT(PRESETS["tiny-gqa"])
    meshes = {"dp": Mesh(dp=4), "zero1": Mesh(dp=4), "zero2": Mesh(dp=4), "fsdp": Mesh(dp=4), "tp": Mesh(tp=4),
              "tp_sp": Mesh(tp=4), "ulysses": Mesh(sp=4), "tp2d": Mesh(row=2, col=2)}
    assert set(meshes) == set(STRATEGIES)
    for name, mesh in meshes.items():
        s = get_strategy(name)
        s.check(mesh, model.config, batch=8)
        for role in ("params", "compute", "grads", "optimizer"):
            s.layouts(role, model.param_dims(), mesh, model.param_shapes())
    fsdp = get_strategy("fsdp")
    lay = fsdp.layouts("params", model.param_dims(), Mesh(dp=4))
    assert str(lay["blocks.0.attn.wq"].spec) == "[dp]"
    assert fsdp.layouts("compute", model.param_dims(), Mesh(dp=4))["blocks.0.attn.wq"].spec.entries == ()
    tp = get_strategy("tp").layouts("params", model.param_dims(), Mesh(tp=4))
    assert str(tp["blocks.0.mlp.w_in"].spec) == "[None, tp]" and str(tp["blocks.0.mlp.w_out"].spec) == "[tp]"


def test_combined_strategies_shard_one_name_over_both_axes():
    s = get_strategy("tp+ulysses")
    mesh = Mesh(tp=2, sp=2)
    spec = s.rules("activations").resolve(("batch", "attn_seq", "heads", "kv"), mesh)
    assert spec.entries == ((), (), ("tp", "sp"), ())
    spec = s.rules("activations").resolve(("batch", "proj_seq", "heads", "kv"), mesh)
    assert spec.entries == ((), ("sp",), ("tp",), ())


@pytest.mark.parametrize("name, mesh, match", [
    ("tp", Mesh(dp=4), r"strategy 'tp' needs mesh axes \['tp'\] but Mesh\(dp=4\) lacks \['tp'\]; e.g. --mesh tp=2"),
    ("tp", Mesh(tp=3), r"heads=8 is not divisible by tp=3, which strategy 'tp' splits it over; kv_heads=4"),
    ("dp+tp", Mesh(dp=3, tp=2), r"batch=8 is not divisible by 3, the data-parallel ranks"),
    ("ulysses", Mesh(sp=8), r"kv_heads=4 is not divisible by sp=8"),
])
def test_strategy_cannot_apply(name, mesh, match):
    with pytest.raises(ValueError, match=match):
        get_strategy(name).check(mesh, PRESETS["tiny-gqa"], batch=8)


@pytest.mark.parametrize("name, match", [
    ("dp+fsdp", r"cannot combine 'dp' and 'fsdp': both use mesh axis \['dp'\]"),
    ("dp+megatron", r"unknown strategy 'megatron' in 'dp\+megatron'; strategies are dp, zero1"),
    ("", r"give a name such as dp, zero1"),
])
def test_strategy_names(name, match):
    with pytest.raises(ValueError, match=match):
        get_strategy(name)
