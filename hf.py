"""Hugging Face interop: GPT-2 and LLaMA models in and out of parlay's neutral parameters.

``from_hf(model)`` (or ``from_hf(hf_config, state_dict)``) gives a ``GPTConfig`` and the flat
float32 parameter dict ``GPT.init`` returns; ``to_hf(config, params)`` gives a ``transformers``
config and a state dict its ``GPT2LMHeadModel`` / ``LlamaForCausalLM`` loads strictly;
``save_hf`` / ``load_hf`` write and read a folder ``from_pretrained`` reads (config.json plus
safetensors; no pickle). Each direction only transposes, reshapes, splits and joins arrays, so
HF -> parlay -> HF gives back the same bits.

Layouts: Hugging Face's ``nn.Linear`` weights are (out, in), GPT-2's ``Conv1D`` weights are
(in, out) with q, k and v packed in ``c_attn``; parlay's are ``wq`` (E, H, D), ``wk``/``wv``
(E, K, D), ``wo`` (H, D, E), ``w_in``/``w_gate`` (E, F), ``w_out`` (F, E), ``lm_head.w`` (E, V).
A head's D features are consecutive in every packed dim; LLaMA's rotary pairs (the two halves of
D, ``rotate_half``) are parlay's. ``transformers`` is imported only when a function needs it.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from .core.layers import Activation
from .core.models.gpt import GPT, GPTConfig, Norm, Positions, config_from_json

__all__ = ["from_hf", "to_hf", "to_hf_model", "save_hf", "load_hf", "FAMILIES", "checkpoint_to_hf",
           "hf_to_checkpoint"]

FAMILIES = ("gpt2", "llama")
_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")  # both are GELU's tanh approximation, parlay's GELU
# Buffers older transformers versions saved with the weights; they hold no parameters.
_IGNORED = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")
_CAUSAL_LM = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}
_LAYER_KEY = {"gpt2": re.compile(r"^transformer\.h\.(\d+)\."), "llama": re.compile(r"^model\.layers\.(\d+)\.")}
_LAYERS_FIELD = {"gpt2": "n_layer", "llama": "num_hidden_layers"}
# Sane bounds on what a config.json may ask for, checked before anything is built from it.
MAX_SIZE = 2**31 - 1  # any one size (an int32 index reaches it)
MAX_LAYERS = 4096
MAX_PARAMS = 10**10  # an import holds the float32 parameters and two zero moments: 12 bytes each
_MAX_JSON = 16 * 2**20  # bytes of config.json or model.safetensors.index.json
_EXACT = ("F32", "BF16", "F16")  # safetensors dtypes float32 holds exactly
# The config fields parlay reads, and what each must be ('?': may be null).
_FIELDS = {
    "gpt2": {"vocab_size": "size", "n_positions": "size", "n_embd": "size", "n_head": "size", "n_layer": "layers",
             "n_inner": "size?", "layer_norm_epsilon": "eps", "activation_function": "str",
             "scale_attn_weights": "bool", "scale_attn_by_inverse_layer_idx": "bool", "add_cross_attention": "bool",
             "tie_word_embeddings": "bool"},
    "llama": {"vocab_size": "size", "hidden_size": "size", "intermediate_size": "size", "num_hidden_layers": "layers",
              "num_attention_heads": "size", "num_key_value_heads": "size?", "head_dim": "size?",
              "max_position_embeddings": "size", "rms_norm_eps": "eps", "rope_theta": "base", "hidden_act": "str",
              "attention_bias": "bool", "mlp_bias": "bool", "tie_word_embeddings": "bool", "rope_parameters": "dict?",
              "rope_scaling": "dict?"},
}


@dataclass(frozen=True)
class _Entry:
    """One Hugging Face tensor: its key and shape, the parlay parameters it holds, and the two
    directions (HF array -> parlay arrays, parlay arrays -> HF array)."""

    key: str
    shape: tuple[int, ...]
    names: tuple[str, ...]
    split: Callable[[np.ndarray], tuple[np.ndarray, ...]]
    join: Callable[..., np.ndarray]


def _same(key, shape, name) -> _Entry:
    return _Entry(key, shape, (name,), lambda a: (a,), lambda a: a)


def _linear(key, shape, name, parlay_shape) -> _Entry:
    """nn.Linear's (out, in) weight: parlay holds its transpose, reshaped."""
    return _Entry(key, shape, (name,), lambda a: (a.T.reshape(parlay_shape),), lambda a: a.reshape(shape[::-1]).T)


def _reshaped(key, shape, name, parlay_shape) -> _Entry:
    return _Entry(key, shape, (name,), lambda a: (a.reshape(parlay_shape),), lambda a: a.reshape(shape))


def _packed_qkv(key, shape, names, parlay_shape) -> _Entry:
    """GPT-2's c_attn: q, k and v side by side in the last dim."""
    def split(a):
        return tuple(p.reshape(parlay_shape) for p in np.split(a, 3, axis=-1))

    def join(*parts):
        return np.concatenate([p.reshape(shape[:-1] + (shape[-1] // 3,)) for p in parts], axis=-1)

    return _Entry(key, shape, names, split, join)


# -- configs --------------------------------------------------------------------------------------

def _reject(family: str, problems: list[str]) -> None:
    if problems:
        raise ValueError(f"this {family} config cannot be represented in parlay: " + "; ".join(problems) + ".")


def _field_problem(name: str, kind: str, v: Any) -> str | None:
    """What is wrong with config field ``name``'s value ``v`` of kind ``kind`` (see ``_FIELDS``), or None."""
    if kind.endswith("?"):
        if v is None:
            return None
        kind = kind[:-1]
    number = isinstance(v, (int, float)) and not isinstance(v, bool)
    if kind in ("size", "layers"):
        top = MAX_LAYERS if kind == "layers" else MAX_SIZE
        if not (isinstance(v, int) and number and 1 <= v <= top):
            return f"{name}={v!r:.40} must be an int from 1 to {top}"
    elif kind == "eps":
        if not (number and math.isfinite(v) and 0 < v < 1):
            return f"{name}={v!r:.40} must be a finite number between 0 and 1 (e.g. 1e-05)"
    elif kind == "base":
        if not (number and math.isfinite(v) and v > 0):
            return f"{name}={v!r:.40} must be a finite positive number (e.g. 10000.0)"
    elif not isinstance(v, {"bool": bool, "str": str, "dict": dict}[kind]):
        return f"{name}={v!r:.40} must be a {kind}" + (" or null" if kind == "dict" else "")
    return None


def _check_fields(family: str, values: Mapping[str, Any], where: str) -> None:
    """One error listing every field parlay reads that ``values`` holds with a bad value."""
    problems = [_field_problem(n, k, values[n]) for n, k in _FIELDS[family].items() if n in values]
    rope = values.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        problems.append(_field_problem("rope_parameters['rope_theta']", "base", rope["rope_theta"]))
    problems = [p for p in problems if p]
    if problems:
        raise ValueError(f"{where}: " + "; ".join(problems) + ".")


def _attrs(family: str, hf) -> dict[str, Any]:
    return {n: getattr(hf, n) for n in _FIELDS[family] if hasattr(hf, n)}


def _gpt2_config(hf, seq: int | None) -> GPTConfig:
    _check_fields("gpt2", _attrs("gpt2", hf), "this gpt2 config")
    problems = []
    if hf.activation_function not in _GELU_TANH:
        problems.append(f"activation_function={hf.activation_function!r}: parlay's GELU is the tanh approximation "
                        f"({' or '.join(map(repr, _GELU_TANH))})")
    if not hf.scale_attn_weights:
        problems.append("scale_attn_weights=False: parlay always scales scores by 1/sqrt(head_dim)")
    if hf.scale_attn_by_inverse_layer_idx:
        problems.append("scale_attn_by_inverse_layer_idx=True: parlay scales every layer's scores alike")
    if hf.add_cross_attention:
        problems.append("add_cross_attention=True: parlay's decoder has no cross-attention")
    if seq is not None and seq != hf.n_positions:
        problems.append(f"seq={seq} differs from n_positions={hf.n_positions}, the rows of the learned position "
                        f"table (parlay's seq); leave seq unset")
    # reorder_and_upcast_attn changes only the order of fp32 operations (and a bf16/fp16 upcast).
    _reject("gpt2", problems)
    return GPTConfig(vocab=hf.vocab_size, seq=hf.n_positions, embed=hf.n_embd, heads=hf.n_head, kv_heads=hf.n_head,
                     layers=hf.n_layer, mlp=hf.n_inner if hf.n_inner is not None else 4 * hf.n_embd,
                     norm=Norm.LAYER, activation=Activation.GELU, eps=float(hf.layer_norm_epsilon),
                     positions=Positions.LEARNED, bias=True, tie_embeddings=bool(hf.tie_word_embeddings))


def _llama_config(hf, seq: int | None) -> GPTConfig:
    _check_fields("llama", _attrs("llama", hf), "this llama config")
    problems = []
    if hf.hidden_act != "silu":
        problems.append(f"hidden_act={hf.hidden_act!r}: parlay's gated MLP is SwiGLU ('silu')")
    # transformers 5 keeps rope_theta and any scaling (what 4.x called rope_scaling) here.
    rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    if rope.get("rope_type", "default") != "default":
        problems.append(f"rope_parameters['rope_type']={rope['rope_type']!r} (rope scaling): parlay has plain "
                        f"rotary positions ('default')")
    extra = sorted(set(rope) - {"rope_type", "rope_theta"})
    if extra:
        problems.append(f"rope_parameters has {extra}: parlay's rotary positions take only rope_theta")
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    if head_dim * hf.num_attention_heads != hf.hidden_size:
        problems.append(f"head_dim={head_dim} with num_attention_heads={hf.num_attention_heads} is not "
                        f"hidden_size={hf.hidden_size}: parlay's head_dim is hidden_size / num_attention_heads")
    if bool(hf.attention_bias) != bool(hf.mlp_bias):
        problems.append(f"attention_bias={hf.attention_bias} but mlp_bias={hf.mlp_bias}: parlay's bias option "
                        f"covers both")
    _reject("llama", problems)
    theta = rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
    _check_fields("llama", {"rope_theta": theta}, "this llama config")
    return GPTConfig(vocab=hf.vocab_size, seq=seq if seq is not None else hf.max_position_embeddings,
                     embed=hf.hidden_size, heads=hf.num_attention_heads,
                     kv_heads=hf.num_key_value_heads or hf.num_attention_heads, layers=hf.num_hidden_layers,
                     mlp=hf.intermediate_size, norm=Norm.RMS, activation=Activation.SWIGLU, eps=float(hf.rms_norm_eps),
                     rope_base=float(theta), positions=Positions.ROTARY, bias=bool(hf.attention_bias),
                     tie_embeddings=bool(hf.tie_word_embeddings))


def _family(config: GPTConfig) -> str:
    """The Hugging Face family a parlay config exports to, or one error listing what does not fit."""
    c = config
    if c.positions is Positions.LEARNED:
        want = {"norm": Norm.LAYER, "activation": Activation.GELU, "bias": True}
        family, problems = "gpt2", ([f"kv_heads={c.kv_heads} differs from heads={c.heads} (GPT-2 has no grouped-query "
                                     f"attention)"] if c.kv_heads != c.heads else [])
    else:
        want = {"norm": Norm.RMS, "activation": Activation.SWIGLU}
        family, problems = "llama", []
    problems += [f"{f}={getattr(c, f)!r} (needs {v!r})" for f, v in want.items() if getattr(c, f) != v]
    if problems:
        kind = "learned positions (GPT-2)" if family == "gpt2" else "rotary positions (LLaMA)"
        raise ValueError(f"GPTConfig with {kind} has no Hugging Face equivalent: " + "; ".join(problems) + ".")
    return family


def _hf_config(config: GPTConfig, overrides: Mapping[str, Any]):
    import transformers

    c = config
    if _family(c) == "gpt2":
        fields = dict(vocab_size=c.vocab, n_positions=c.seq, n_embd=c.embed, n_layer=c.layers, n_head=c.heads,
                      n_inner=c.mlp, activation_function="gelu_new", layer_norm_epsilon=c.eps,
                      tie_word_embeddings=c.tie_embeddings, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        if c.vocab <= 50256:  # GPT-2's <|endoftext|> id is outside a smaller vocabulary
            fields.update(bos_token_id=None, eos_token_id=None)
        return transformers.GPT2Config(**{**fields, **overrides})
    fields = dict(vocab_size=c.vocab, hidden_size=c.embed, intermediate_size=c.mlp, num_hidden_layers=c.layers,
                  num_attention_heads=c.heads, num_key_value_heads=c.kv_heads, head_dim=c.head_dim,
                  max_position_embeddings=c.seq, rms_norm_eps=c.eps, hidden_act="silu",
                  rope_parameters={"rope_type": "default", "rope_theta": c.rope_base},
                  attention_bias=c.bias, mlp_bias=c.bias, tie_word_embeddings=c.tie_embeddings)
    if c.vocab <= 2:
        fields.update(bos_token_id=None, eos_token_id=None)
    return transformers.LlamaConfig(**{**fields, **overrides})


# -- tensors --------------------------------------------------------------------------------------

def _entries(family: str, c: GPTConfig) -> list[_Entry]:
    E, H, K, D, F, V = c.embed, c.heads, c.kv_heads, c.head_dim, c.mlp, c.vocab
    out = []
    if family == "gpt2":
        out += [_same("transformer.wte.weight", (V, E), "embed.table"),
                _same("transformer.wpe.weight", (c.seq, E), "pos_embed.table")]
        for i in range(c.layers):
            h, b = f"transformer.h.{i}", f"blocks.{i}"
            out += [
                _same(f"{h}.ln_1.weight", (E,), f"{b}.norm1.scale"), _same(f"{h}.ln_1.bias", (E,), f"{b}.norm1.bias"),
                _packed_qkv(f"{h}.attn.c_attn.weight", (E, 3 * E), (f"{b}.attn.wq", f"{b}.attn.wk", f"{b}.attn.wv"),
                            (E, H, D)),
                _packed_qkv(f"{h}.attn.c_attn.bias", (3 * E,), (f"{b}.attn.bq", f"{b}.attn.bk", f"{b}.attn.bv"), (H, D)),
                _reshaped(f"{h}.attn.c_proj.weight", (E, E), f"{b}.attn.wo", (H, D, E)),
                _same(f"{h}.attn.c_proj.bias", (E,), f"{b}.attn.bo"),
                _same(f"{h}.ln_2.weight", (E,), f"{b}.norm2.scale"), _same(f"{h}.ln_2.bias", (E,), f"{b}.norm2.bias"),
                _same(f"{h}.mlp.c_fc.weight", (E, F), f"{b}.mlp.w_in"), _same(f"{h}.mlp.c_fc.bias", (F,), f"{b}.mlp.b_in"),
                _same(f"{h}.mlp.c_proj.weight", (F, E), f"{b}.mlp.w_out"),
                _same(f"{h}.mlp.c_proj.bias", (E,), f"{b}.mlp.b_out"),
            ]
        out += [_same("transformer.ln_f.weight", (E,), "final_norm.scale"),
                _same("transformer.ln_f.bias", (E,), "final_norm.bias")]
    else:
        out.append(_same("model.embed_tokens.weight", (V, E), "embed.table"))
        for i in range(c.layers):
            h, b = f"model.layers.{i}", f"blocks.{i}"
            out += [
                _linear(f"{h}.self_attn.q_proj.weight", (H * D, E), f"{b}.attn.wq", (E, H, D)),
                _linear(f"{h}.self_attn.k_proj.weight", (K * D, E), f"{b}.attn.wk", (E, K, D)),
                _linear(f"{h}.self_attn.v_proj.weight", (K * D, E), f"{b}.attn.wv", (E, K, D)),
                _linear(f"{h}.self_attn.o_proj.weight", (E, H * D), f"{b}.attn.wo", (H, D, E)),
                _linear(f"{h}.mlp.gate_proj.weight", (F, E), f"{b}.mlp.w_gate", (E, F)),
                _linear(f"{h}.mlp.up_proj.weight", (F, E), f"{b}.mlp.w_in", (E, F)),
                _linear(f"{h}.mlp.down_proj.weight", (E, F), f"{b}.mlp.w_out", (F, E)),
                _same(f"{h}.input_layernorm.weight", (E,), f"{b}.norm1.scale"),
                _same(f"{h}.post_attention_layernorm.weight", (E,), f"{b}.norm2.scale"),
            ]
            if c.bias:
                out += [
                    _reshaped(f"{h}.self_attn.q_proj.bias", (H * D,), f"{b}.attn.bq", (H, D)),
                    _reshaped(f"{h}.self_attn.k_proj.bias", (K * D,), f"{b}.attn.bk", (K, D)),
                    _reshaped(f"{h}.self_attn.v_proj.bias", (K * D,), f"{b}.attn.bv", (K, D)),
                    _same(f"{h}.self_attn.o_proj.bias", (E,), f"{b}.attn.bo"),
                    _same(f"{h}.mlp.gate_proj.bias", (F,), f"{b}.mlp.b_gate"),
                    _same(f"{h}.mlp.up_proj.bias", (F,), f"{b}.mlp.b_in"),
                    _same(f"{h}.mlp.down_proj.bias", (E,), f"{b}.mlp.b_out"),
                ]
        out.append(_same("model.norm.weight", (E,), "final_norm.scale"))
    if not c.tie_embeddings:
        out.append(_linear("lm_head.weight", (V, E), "lm_head.w", (E, V)))
    return out


def _embed_key(family: str) -> str:
    return "transformer.wte.weight" if family == "gpt2" else "model.embed_tokens.weight"


def _to_numpy(key: str, t) -> np.ndarray:
    if hasattr(t, "detach"):  # a torch tensor: float32 holds fp32, bf16 and fp16 values exactly
        import torch

        if not t.is_floating_point():
            raise TypeError(f"state dict entry {key!r} has dtype {t.dtype}; parameters are floating point.")
        return t.detach().to("cpu", torch.float32).numpy()
    a = np.asarray(t)
    if a.dtype.kind != "f":
        raise TypeError(f"state dict entry {key!r} has dtype {a.dtype}; parameters are floating point.")
    return a.astype(np.float32)


def _few(names: list[str]) -> str:
    return f"{names[:5]}" + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _check_state(family: str, config: GPTConfig, shapes: Mapping[str, tuple[int, ...]]) -> list[_Entry]:
    """The config's entries, once ``shapes`` (each tensor's key and shape) holds exactly them;
    else one error listing what is missing, unexpected or of the wrong shape. The layer count is
    checked against the tensors first, so a config cannot make parlay list more layers than the
    tensors hold."""
    head = f"{family} state dict does not match its config (vocab={config.vocab}, embed={config.embed}, " \
           f"layers={config.layers}): "
    found = {int(m.group(1)) for k in shapes if (m := _LAYER_KEY[family].match(k))}
    if config.layers > len(found):
        raise ValueError(head + f"{_LAYERS_FIELD[family]}={config.layers} but the tensors hold {len(found)} "
                         f"layer{'s' * (len(found) != 1)}; the config's layer count must match the weights.")
    entries = _entries(family, config)
    expected = {e.key for e in entries}
    tied_head = config.tie_embeddings and "lm_head.weight" in shapes
    unexpected = sorted(k for k in shapes if k not in expected and not k.endswith(_IGNORED)
                        and not (tied_head and k == "lm_head.weight"))
    missing = sorted(expected - set(shapes))
    problems = [f"missing {_few(missing)}"] if missing else []
    problems += [f"unexpected {_few(unexpected)}"] if unexpected else []
    problems += [f"{e.key!r} has shape {shapes[e.key]}, the config says {e.shape}" for e in entries
                 if e.key in shapes and shapes[e.key] != e.shape][:5]
    if problems:
        raise ValueError(head + "; ".join(problems) + ".")
    return entries


def from_hf(model_or_config, state_dict: Mapping[str, Any] | None = None, *,
            seq: int | None = None) -> tuple[GPTConfig, dict[str, np.ndarray]]:
    """A ``GPT2LMHeadModel`` or ``LlamaForCausalLM`` (or its config plus a state dict of torch
    tensors or numpy arrays) as ``(GPTConfig, params)``, params float32 numpy named as
    ``GPT.init``'s. ``seq``: parlay's sequence length for LLaMA (default max_position_embeddings);
    GPT-2's is n_positions, the rows of its position table."""
    hf = model_or_config
    if state_dict is None:
        if not hasattr(hf, "state_dict") or not hasattr(hf, "config"):
            raise TypeError(f"from_hf takes a transformers model, or a config and its state dict; got "
                            f"{type(hf).__name__} and no state dict.")
        hf, state_dict = hf.config, hf.state_dict()
    family = getattr(hf, "model_type", None)
    if family not in FAMILIES:
        raise ValueError(f"model_type={family!r}: parlay imports {' and '.join(map(repr, FAMILIES))} models.")
    config = _gpt2_config(hf, seq) if family == "gpt2" else _llama_config(hf, seq)
    entries = _check_state(family, config, {k: tuple(v.shape) for k, v in state_dict.items()})
    tied_head = config.tie_embeddings and "lm_head.weight" in state_dict
    params: dict[str, np.ndarray] = {}
    for e in entries:
        params.update(zip(e.names, (np.ascontiguousarray(a) for a in e.split(_to_numpy(e.key, state_dict[e.key])))))
    if tied_head and not np.array_equal(_to_numpy("lm_head.weight", state_dict["lm_head.weight"]), params["embed.table"]):
        raise ValueError(f"tie_word_embeddings=True but 'lm_head.weight' differs from {_embed_key(family)!r}; "
                         f"a tied model has one table (set tie_word_embeddings=False to keep both).")
    shapes = GPT(config).param_shapes()
    assert {k: v.shape for k, v in params.items()} == shapes, "internal: converted shapes differ from GPT's"
    return config, {k: params[k] for k in shapes}


def to_hf(config: GPTConfig, params: Mapping[str, np.ndarray], **hf_overrides):
    """``(hf_config, state_dict)``: a ``GPT2Config`` (learned positions) or ``LlamaConfig``
    (rotary), and float32 torch tensors keyed as that model's ``state_dict()`` (a tied
    ``lm_head.weight`` is the embedding's tensor). ``hf_overrides`` set other config fields
    (token ids, dropout, ...)."""
    import torch

    family = _family(config)
    shapes = GPT(config).param_shapes()
    missing, extra = sorted(set(shapes) - set(params)), sorted(set(params) - set(shapes))
    wrong = [f"{k!r} has shape {tuple(np.shape(params[k]))}, the config says {s}" for k, s in shapes.items()
             if k in params and tuple(np.shape(params[k])) != s]
    if missing or extra or wrong:
        raise ValueError("params do not match the config: " + "; ".join(
            ([f"missing {missing}"] if missing else []) + ([f"unexpected {extra}"] if extra else []) + wrong) + ".")
    state = {}
    for e in _entries(family, config):
        arrays = [_to_numpy(n, params[n]) for n in e.names]
        state[e.key] = torch.from_numpy(np.ascontiguousarray(e.join(*arrays)))
    if config.tie_embeddings:
        state["lm_head.weight"] = state[_embed_key(family)]
    return _hf_config(config, hf_overrides), state


def to_hf_model(config: GPTConfig, params: Mapping[str, np.ndarray], **hf_overrides):
    """A ``transformers`` model (eval mode, float32) holding ``params``, loaded strictly."""
    import transformers

    hf_config, state = to_hf(config, params, **hf_overrides)
    cls = transformers.GPT2LMHeadModel if hf_config.model_type == "gpt2" else transformers.LlamaForCausalLM
    model = cls(hf_config)
    model.load_state_dict(state, strict=True)
    return model.eval()


def save_hf(path: str | Path, config: GPTConfig, params: Mapping[str, np.ndarray], **hf_overrides) -> Path:
    """A folder ``transformers.AutoModelForCausalLM.from_pretrained`` loads: config.json and
    model.safetensors (a tied LM head is stored once, as transformers does)."""
    path = Path(path)
    _check_folder(path, "a Hugging Face model is a folder (config.json + model.safetensors)")
    to_hf_model(config, params, **hf_overrides).save_pretrained(path)
    return path


def _check_folder(path: Path, what: str) -> None:
    """``path`` is a folder, or one can be made there (its nearest existing parent is a folder)."""
    there = path if os.path.lexists(path) else next((p for p in path.absolute().parents if os.path.lexists(p)), None)
    if there is not None and not there.is_dir():
        made = "" if there is path else f", so {path} cannot be made"
        raise ValueError(f"{there} exists and is not a folder{made}; {what}: give a folder path")


def _check_out(path: Path) -> None:
    """``path`` can take a new Hugging Face folder: it holds no model files (nothing is overwritten)."""
    _check_folder(path, "a Hugging Face model is a folder (config.json + model.safetensors)")
    taken = sorted(p.name for p in path.iterdir() if p.name in ("config.json", "generation_config.json")
                   or p.name.endswith((".safetensors", ".safetensors.index.json"))) if path.is_dir() else []
    if taken:
        raise ValueError(f"{path} already holds {_few(taken)}; export-hf never overwrites a model: remove "
                         f"{'it' if len(taken) == 1 else 'them'} or choose another folder")


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300] or type(e).__name__


def _inside(folder: Path, name: Any, named_by: str = "the folder") -> Path:
    """``folder/name`` resolved: a regular file directly inside ``folder`` (``folder`` resolved; a
    symlink may point only at another file there)."""
    if not isinstance(name, str) or name in ("", ".", "..") or any(c in name for c in "/\\\0"):
        raise ValueError(f"{named_by} names {name!r:.80}; parlay reads only files directly inside {folder}: give a "
                         f"plain file name")
    given = folder / name
    if not os.path.lexists(given):
        raise ValueError(f"{given} does not exist ({named_by} names it); give a folder with all its files")
    try:
        path = given.resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop
        raise ValueError(f"{given} cannot be resolved ({_one_line(e)}); replace the link by the file") from None
    if path.parent != folder:
        raise ValueError(f"{given} resolves to {path}, outside {folder}; parlay reads only files directly inside the "
                         f"folder: copy the file in (cp -L)")
    if not path.is_file():
        raise ValueError(f"{given} is not a regular file (a folder, pipe or device); put the file itself there")
    return path


def _read_json(path: Path, what: str) -> dict:
    """A JSON object from ``path`` (at most ``_MAX_JSON`` bytes), or one error naming ``what`` it is."""
    size = path.stat().st_size
    if size > _MAX_JSON:
        raise ValueError(f"{path} is {size} bytes, over parlay's {_MAX_JSON} for a {what}; give the folder's own "
                         f"{path.name}")
    try:
        data = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as e:  # bad JSON or UTF-8; nesting too deep
        raise ValueError(f"{path} is not valid JSON ({_one_line(e)}); give the {what} save_pretrained wrote") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}, not an object; give the {what} save_pretrained "
                         f"wrote")
    return data


def _read_config(folder: Path):
    """config.json, checked before transformers builds anything from it: ``(family, hf_config)``."""
    import transformers

    if not os.path.lexists(folder / "config.json"):
        raise ValueError(f"{folder} has no config.json; give a folder written by save_hf or save_pretrained.")
    path = _inside(folder, "config.json")
    raw = _read_json(path, "model config")
    family = raw.get("model_type")
    if family not in FAMILIES:
        raise ValueError(f"{path}: model_type={family!r:.80}: parlay imports {' and '.join(map(repr, FAMILIES))} "
                         f"models.")
    arch = raw.get("architectures")
    if arch is not None and (not isinstance(arch, list) or _CAUSAL_LM[family] not in arch):
        raise ValueError(f"{path}: architectures={arch!r:.80}: parlay imports {_CAUSAL_LM[family]} "
                         f"({family}'s language model); export that model's folder")
    _check_fields(family, raw, str(path))
    try:
        hf = transformers.AutoConfig.from_pretrained(folder)
    except Exception as e:  # transformers' own checks, of fields parlay does not read
        raise ValueError(f"{path}: transformers refuses it ({_one_line(e)}); fix that field") from None
    return family, hf


def _weight_files(folder: Path) -> list[Path]:
    """The safetensors files of ``folder``: model.safetensors, or those its index names (each
    directly inside ``folder``)."""
    if os.path.lexists(folder / "model.safetensors.index.json"):
        index = _inside(folder, "model.safetensors.index.json")
        data = _read_json(index, "safetensors index")
        weight_map = data.get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index}: 'weight_map' must be an object of tensor name -> file name, not "
                             f"{weight_map!r:.80}; give the index save_pretrained wrote")
        names = sorted(set(weight_map.values()))
        bad = [n for n in names if not n.endswith(".safetensors")]
        if bad:
            raise ValueError(f"{index}: weight_map names {bad[0]!r:.80}; parlay reads .safetensors files only, "
                             f"never pickled weights")
        return [_inside(folder, n, f"{index.name}'s weight_map") for n in names]
    if os.path.lexists(folder / "model.safetensors"):
        return [_inside(folder, "model.safetensors")]
    raise ValueError(f"{folder} has no model.safetensors (or model.safetensors.index.json); parlay reads "
                     f"safetensors only, never pickled weights (pytorch_model.bin).")


def _headers(files: list[Path]) -> dict[str, tuple[Path, str, tuple[int, ...]]]:
    """Each tensor's file, dtype and shape, from the files' headers (no data read)."""
    from safetensors import safe_open

    out: dict[str, tuple[Path, str, tuple[int, ...]]] = {}
    for path in files:
        found = {}
        try:
            with safe_open(path, framework="pt") as f:
                for k in f.keys():
                    t = f.get_slice(k)
                    found[k] = (t.get_dtype(), tuple(t.get_shape()))
        except Exception as e:  # SafetensorError: truncated, garbled, offsets that do not cover the file
            raise ValueError(f"{path} is not a valid safetensors file ({_one_line(e)}); save the model again "
                             f"with save_pretrained") from None
        for k, (dtype, shape) in found.items():
            if k in out:
                raise ValueError(f"tensor {k!r:.80} is in both {out[k][0].name} and {path.name}; a tensor lives "
                                 f"in one file")
            if dtype not in _EXACT and not k.endswith(_IGNORED):
                raise ValueError(f"{path}: tensor {k!r:.80} is {dtype}; parlay reads {', '.join(_EXACT)} (float32 "
                                 f"holds them exactly): save the model as float32, bfloat16 or float16")
            out[k] = (path, dtype, shape)
    return out


def load_hf(path: str | Path, *, seq: int | None = None) -> tuple[GPTConfig, dict[str, np.ndarray]]:
    """``from_hf`` of a saved folder: config.json and safetensors weights (one file or an index
    of shards), read without building the model or unpickling anything. Every file must lie
    directly inside the folder; the config and the tensors' headers are checked against each other,
    and against ``MAX_PARAMS``, before any tensor data is read."""
    from safetensors.torch import load_file

    if not Path(path).is_dir():
        what = "is not a folder" if os.path.lexists(path) else "does not exist"
        raise ValueError(f"{path} {what}; give a folder written by save_hf or save_pretrained.")
    folder = Path(path).resolve()
    family, hf = _read_config(folder)
    config = _gpt2_config(hf, seq) if family == "gpt2" else _llama_config(hf, seq)
    files = _weight_files(folder)
    headers = _headers(files)
    entries = _check_state(family, config, {k: shape for k, (_, _, shape) in headers.items()})
    count = sum(math.prod(e.shape) for e in entries)
    if count > MAX_PARAMS:
        raise ValueError(f"{path} holds {count:,} parameters, over parlay's import limit of {MAX_PARAMS:,} (an "
                         f"import holds them as float32 with two AdamW moments in memory)")
    state = {}
    for f in files:
        state.update(load_file(f))
    return from_hf(hf, state, seq=seq)


# -- parlay checkpoints <-> Hugging Face folders ----------------------------------------------------

def checkpoint_to_hf(checkpoint: str | Path, out: str | Path, **hf_overrides) -> Path:
    """A parlay checkpoint of a GPT (any backend, strategy or mesh) as a Hugging Face folder:
    ``out``, which must not hold a model already."""
    from .checkpoint import Checkpoint, CheckpointError

    _check_out(Path(out))
    ckpt = Checkpoint(checkpoint)
    where = f"{ckpt.path}/manifest.json: field 'model'"
    model = ckpt.meta("model")
    describe = model.get("describe") if isinstance(model, dict) else None
    if not isinstance(describe, dict) or describe.get("kind") != "gpt":
        raise CheckpointError(f"{where}: the checkpoint holds {model.get('ref') if isinstance(model, dict) else model!r}, "
                              f"not a parlay GPT; export-hf writes GPT-2 and LLaMA models only")
    config = config_from_json(describe.get("config"), f"{where}.describe.config")
    shapes = GPT(config).param_shapes()
    params = {k: ckpt.read(f"params/{k}", shape=shape) for k, shape in shapes.items()}
    # parlay's vocabularies (bytes) have no special tokens: none for generate() to stop at.
    overrides = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **hf_overrides}
    return save_hf(out, config, params, **overrides)


def hf_to_checkpoint(folder: str | Path, root: str | Path, *, step: int = 0, seq: int | None = None) -> Path:
    """A Hugging Face folder as a parlay checkpoint at ``step`` (AdamW moments zero, no updates
    yet), loadable into any backend, strategy and mesh. Never replaces a checkpoint: the step's
    folder must not exist yet."""
    from . import checkpoint

    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step {step!r} is negative: checkpoint folders are step-NNNNNNNN, a count of updates from "
                         f"0; give --step 0 or more")
    root = Path(root)
    _check_folder(root, "checkpoints are written into a folder (made if missing)")
    _check_target(root, step)  # before reading anything
    config, params = load_hf(folder, seq=seq)
    with checkpoint.locked(root):  # not into a folder a training run is writing
        _check_target(root, step)
        return _write_imported(root, step, folder, config, params)


def _check_target(root: Path, step: int) -> None:
    from . import checkpoint

    target = checkpoint.step_dir(root, step)
    if os.path.lexists(target):
        held = "a committed checkpoint" if (target / "manifest.json").is_file() else "something already"
        raise ValueError(f"{target} holds {held}; import-hf never replaces it: give another --step or another "
                         f"folder")


def _write_imported(root: Path, step: int, folder, config, params) -> Path:
    from dataclasses import asdict

    from . import checkpoint
    from .core import Layout, Mesh, P
    from .core.optim import OptimizerConfig

    model = GPT(config)
    whole = Layout(Mesh(dp=1), P())
    tensors, blocks = [], {}
    for kind in ("params", "opt/mu", "opt/nu"):
        for k, v in params.items():
            name = f"{kind}/{k}"
            pieces = checkpoint.pieces_of(name, whole, v.shape)
            tensors.append((name, v.shape, str(whole), pieces))
            blocks.setdefault(pieces[0].file, {})[pieces[0].key] = v if kind == "params" else np.zeros_like(v)
    meta = {"count": 0, "backend": "hf", "model": {"ref": None, "describe": model.describe(),
                                                   "params": {k: list(v) for k, v in model.param_shapes().items()}},
            "mesh": {"dp": 1}, "strategy": "dp", "optimizer": asdict(OptimizerConfig()),
            "data": {}, "rng": {}, "losses": [], "evals": [], "source": str(folder)}
    checkpoint.save(root, step, tensors, blocks, meta)
    return checkpoint.step_dir(root, step)
