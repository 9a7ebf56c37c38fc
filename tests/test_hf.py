"""Hugging Face interop: GPT-2 and LLaMA models, randomly initialised here (nothing downloaded),
give the same logits in parlay as in transformers, and their weights cross over bit for bit.

Tolerance (fp32): logits to 1e-5 of the largest |logit|: the same sums in another order, and for
LLaMA rotary tables computed in float64 here and float32 there. Measured: at most 9e-7 (torch
and JAX references alike). Every parameter is drawn at random first (norm scales around 1,
biases and weights with std 0.1), so a bias or scale mapped to the wrong place cannot hide
behind transformers' zeros-and-ones initialisation.
"""

import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers  # the `test` extra pins it; a missing install fails here, it never skips

from parlay.backends.jax.ops import JaxLocal
from parlay.backends.torch.ops import TorchLocal
from parlay.core.models.gpt import GPT, PRESETS, Norm
from parlay.core.ops import DenseOps
from parlay.hf import from_hf, load_hf, save_hf, to_hf, to_hf_model

V = 96  # not a power of two, not 256: the vocabulary is whatever the model has

GPT2 = dict(vocab_size=V, n_positions=16, n_embd=64, n_layer=2, n_head=8, bos_token_id=None, eos_token_id=None)
LLAMA = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
             max_position_embeddings=16)
CASES = {
    "gpt2": (transformers.GPT2Config, GPT2),
    "gpt2-untied-eager-reordered": (transformers.GPT2Config, {**GPT2, "tie_word_embeddings": False, "n_inner": 96,
                                                              "reorder_and_upcast_attn": True,
                                                              "layer_norm_epsilon": 1e-6}),
    "llama-gqa": (transformers.LlamaConfig, {**LLAMA, "num_key_value_heads": 2}),
    "llama-gqa-tied-bias": (transformers.LlamaConfig, {**LLAMA, "num_key_value_heads": 4, "tie_word_embeddings": True,
                                                       "attention_bias": True, "mlp_bias": True, "rms_norm_eps": 1e-5,
                                                       "rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}),
    "llama-mha-tied": (transformers.LlamaConfig, {**LLAMA, "tie_word_embeddings": True}),
}


def _hf_model(name: str, seed: int):
    cls, kwargs = CASES[name]
    config = cls(**kwargs)
    if "eager" in name:
        config._attn_implementation = "eager"  # reorder_and_upcast_attn acts only there
    torch.manual_seed(seed)
    model = (transformers.GPT2LMHeadModel if cls is transformers.GPT2Config else transformers.LlamaForCausalLM)(config)
    with torch.no_grad():
        for n, p in model.named_parameters():
            is_scale = n.endswith("weight") and ("ln_" in n or "norm" in n)
            p.copy_((1.0 if is_scale else 0.0) + 0.1 * torch.randn_like(p))
    return model.eval()


def _parlay_logits(config, params, tokens):
    model = GPT(config)
    t = model.logits(DenseOps(TorchLocal()), {k: torch.from_numpy(v) for k, v in params.items()}, torch.as_tensor(tokens))
    j = model.logits(DenseOps(JaxLocal()), {k: jnp.asarray(v) for k, v in params.items()}, jnp.asarray(tokens))
    return t.detach().numpy(), np.asarray(j)


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.as_tensor(tokens)).logits.numpy()


@pytest.mark.parametrize("name", list(CASES))
def test_logits_equal_transformers_and_weights_cross_back_exactly(name):
    seed = list(CASES).index(name)
    hf = _hf_model(name, seed)
    config, params = from_hf(hf)
    assert config.tie_embeddings == hf.config.tie_word_embeddings
    assert ("lm_head.w" in params) != config.tie_embeddings
    tokens = np.random.default_rng(seed).integers(0, V, (4, config.seq))
    want = _hf_logits(hf, tokens)
    for got in _parlay_logits(config, params, tokens):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    # HF -> parlay -> HF: the same keys and the same bits.
    hf_config, state = to_hf(config, params)
    original = hf.state_dict()
    assert set(state) == set(original)
    for k, t in original.items():
        assert state[k].dtype == t.dtype and torch.equal(state[k], t), k
    assert type(hf_config) is type(hf.config)


def test_export_gives_transformers_the_same_model():
    """parlay -> HF: the tiny-gpt2-hf preset and a GQA LLaMA-style config, with random weights."""
    for config in [PRESETS["tiny-gpt2-hf"].with_(vocab=V), PRESETS["tiny-gqa"].with_(vocab=V, bias=True, tie_embeddings=True)]:
        rng = np.random.default_rng(7)
        params = {k: (v + 0.1 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in GPT(config).init(1).items()}
        tokens = rng.integers(0, V, (3, config.seq))
        want = _parlay_logits(config, params, tokens)[0]
        got = _hf_logits(to_hf_model(config, params), tokens)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
        # parlay -> HF -> parlay: the same config and bits.
        back_config, back = from_hf(*to_hf(config, params))
        assert back_config == config
        assert set(back) == set(params) and all(np.array_equal(back[k], params[k]) for k in params)


def test_save_and_load_a_folder(tmp_path):
    hf = _hf_model("llama-gqa-tied-bias", 11)
    config, params = from_hf(hf)
    path = save_hf(tmp_path / "model", config, params)
    assert (path / "model.safetensors").is_file() and (path / "config.json").is_file()
    back_config, back = load_hf(path)
    assert back_config == config
    assert all(np.array_equal(back[k], params[k]) for k in params) and set(back) == set(params)
    # transformers reads the folder itself (no network: a local path).
    loaded = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    tokens = np.random.default_rng(3).integers(0, V, (2, config.seq))
    np.testing.assert_array_equal(_hf_logits(loaded, tokens), _hf_logits(hf, tokens))


def test_load_refuses_pickled_weights(tmp_path):
    with pytest.raises(ValueError, match=r"has no config.json; give a folder written by save_hf"):
        load_hf(tmp_path)
    hf = _hf_model("gpt2", 5)
    hf.config.save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ValueError, match=r"has no model.safetensors .*safetensors only, never pickled weights"):
        load_hf(tmp_path)


@pytest.mark.parametrize("cls, changes, message", [
    (transformers.GPT2Config, {"scale_attn_by_inverse_layer_idx": True},
     r"gpt2 config cannot be represented in parlay: scale_attn_by_inverse_layer_idx=True"),
    (transformers.GPT2Config, {"activation_function": "relu"}, r"activation_function='relu': parlay's GELU is the tanh"),
    (transformers.GPT2Config, {"scale_attn_weights": False}, r"scale_attn_weights=False"),
    (transformers.LlamaConfig, {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
     r"llama config cannot be represented in parlay: rope_parameters\['rope_type'\]='linear' \(rope scaling\)"),
    (transformers.LlamaConfig, {"attention_bias": True}, r"attention_bias=True but mlp_bias=False"),
    (transformers.LlamaConfig, {"hidden_act": "gelu"}, r"hidden_act='gelu': parlay's gated MLP is SwiGLU"),
    (transformers.LlamaConfig, {"head_dim": 16}, r"head_dim=16 with num_attention_heads=8 is not hidden_size=64"),
])
def test_unsupported_configs_fail_naming_the_field(cls, changes, message):
    base = GPT2 if cls is transformers.GPT2Config else LLAMA
    config = cls(**{**base, **changes})
    with pytest.raises(ValueError, match=message):
        from_hf(config, {})


def test_bad_inputs_fail_with_one_clear_error():
    hf = _hf_model("gpt2", 2)
    state = dict(hf.state_dict())
    with pytest.raises(ValueError, match=r"model_type='bert': parlay imports 'gpt2' and 'llama' models"):
        from_hf(transformers.BertConfig(), state)
    short = {k: v for k, v in state.items() if k != "transformer.h.1.mlp.c_fc.bias"}
    with pytest.raises(ValueError, match=r"state dict does not match its config .*missing \['transformer.h.1.mlp.c_fc.bias'\]"):
        from_hf(hf.config, short)
    with pytest.raises(ValueError, match=r"'transformer.wpe.weight' has shape \(8, 64\), the config says \(16, 64\)"):
        from_hf(hf.config, {**state, "transformer.wpe.weight": state["transformer.wpe.weight"][:8]})
    with pytest.raises(ValueError, match=r"tie_word_embeddings=True but 'lm_head.weight' differs"):
        from_hf(hf.config, {**state, "lm_head.weight": state["lm_head.weight"] + 1})
    with pytest.raises(ValueError, match=r"unexpected \['transformer.h.9.attn.c_proj.weight'\]"):
        from_hf(hf.config, {**state, "transformer.h.9.attn.c_proj.weight": state["transformer.h.0.attn.c_proj.weight"]})
    with pytest.raises(ValueError, match=r"seq=8 differs from n_positions=16"):
        from_hf(hf, seq=8)
    with pytest.raises(TypeError, match=r"'transformer.ln_f.bias' has dtype torch.int64; parameters are floating"):
        from_hf(hf.config, {**state, "transformer.ln_f.bias": torch.zeros(64, dtype=torch.int64)})
    with pytest.raises(TypeError, match=r"from_hf takes a transformers model, or a config and its state dict; got dict"):
        from_hf(state)
    # Export: a parlay config with no Hugging Face equivalent, and params that do not fit it.
    learned_rms = PRESETS["tiny-gpt2-hf"].with_(norm=Norm.RMS)
    with pytest.raises(ValueError, match=r"learned positions \(GPT-2\) has no Hugging Face equivalent: norm=<Norm.RMS"):
        to_hf(learned_rms, GPT(learned_rms).init(0))
    config, params = from_hf(hf)
    with pytest.raises(ValueError, match=r"params do not match the config: missing \['pos_embed.table'\]"):
        to_hf(config, {k: v for k, v in params.items() if k != "pos_embed.table"})


def test_parlay_imports_without_transformers():
    code = "import sys, parlay.hf, parlay.core.model; assert 'transformers' not in sys.modules and 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
