import numpy as np
import pytest

from parlay import Mesh
from parlay.core.layers import Init, ParamDecl, init_params
from parlay.core.model import Model, check_model
from parlay.core.models.gpt import GPT, PRESETS, GPTConfig, Positions
from parlay.core.program import make_program
from parlay.core.strategies import STRATEGIES, Role, get_strategy


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
    """The preset's comment says 162M (untied head, padded vocab, rotary: no position table) and
    124M for GPT-2's own layout (tied head, 50257 vocab, learned positions)."""
    n = sum(int(np.prod(s)) for s in GPT(PRESETS["gpt2-small"]).param_shapes().values())
    assert n == 162_240_000, n
    hf = PRESETS["gpt2-small"].with_(vocab=50257, tie_embeddings=True, positions=Positions.LEARNED, bias=True)
    n = sum(int(np.prod(s)) for s in GPT(hf).param_shapes().values())
    assert 124.0e6 < n < 124.9e6, n  # 124,439,808 in transformers' GPT2LMHeadModel


def test_the_gpt_meets_the_model_protocol():
    model = GPT(PRESETS["tiny"])
    assert isinstance(model, Model) and check_model(model) is model
    inputs = model.inputs(8)
    assert set(inputs) == {"tokens", "targets"} and inputs["tokens"].shape == (8, 16)
    assert inputs["tokens"].dims == ("batch", "input_seq") and inputs["targets"].high == 256
    assert model.describe()["kind"] == "gpt"
    with pytest.raises(TypeError, match=r"model is dict, which lacks decls\(\), inputs\(\), loss\(\)"):
        check_model({})


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
              "tp_sp": Mesh(tp=4), "ulysses": Mesh(sp=4), "tp2d": Mesh(row=2, col=2), "pp": Mesh(pp=2),
              "ring": Mesh(cp=4), "ring_contiguous": Mesh(cp=4), "tp2.5d": Mesh(row=2, col=2, dep=2),
              "tp3d": Mesh(x=2, y=2, z=2)}
    assert set(meshes) == set(STRATEGIES)
    for name, mesh in meshes.items():
        p = make_program(model, name, mesh, batch=8)
        assert all(set(p.layouts[role]) == set(p.shapes) for role in (Role.PARAMS, Role.COMPUTE, Role.GRADS))
    fsdp = make_program(model, "fsdp", Mesh(dp=4), batch=8).layouts
    assert str(fsdp[Role.PARAMS]["blocks.0.attn.wq"].spec) == "[dp]"
    assert fsdp[Role.COMPUTE]["blocks.0.attn.wq"].spec.entries == ()
    tp = make_program(model, "tp", Mesh(tp=4), batch=8).layouts[Role.PARAMS]
    assert str(tp["blocks.0.mlp.w_in"].spec) == "[None, tp]" and str(tp["blocks.0.mlp.w_out"].spec) == "[tp]"


def test_combined_strategies_shard_one_name_over_both_axes():
    s = get_strategy("tp+ulysses")
    mesh = Mesh(tp=2, sp=2)
    spec = s.rules("activations").resolve(("batch", "attn_seq", "heads", "kv"), mesh)
    assert spec.entries == ((), (), ("tp", "sp"), ())
    spec = s.rules("activations").resolve(("batch", "proj_seq", "heads", "kv"), mesh)
    assert spec.entries == ((), ("sp",), ("tp",), ())


@pytest.mark.parametrize("name, match", [
    ("dp+fsdp", r"cannot combine 'dp' and 'fsdp': both use mesh axis \['dp'\]"),
    ("dp+megatron", r"unknown strategy 'megatron' in 'dp\+megatron'; strategies are dp, zero1"),
    ("", r"give a name such as dp, zero1"),
])
def test_strategy_names(name, match):
    with pytest.raises(ValueError, match=match):
        get_strategy(name)
