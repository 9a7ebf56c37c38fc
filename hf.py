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


def _gpt2_config(hf, seq: int | None) -> GPTConfig:
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
    entries = _entries(family, config)
    expected = {e.key for e in entries}
    tied_head = config.tie_embeddings and "lm_head.weight" in state_dict
    unexpected = sorted(k for k in state_dict if k not in expected and not k.endswith(_IGNORED)
                        and not (tied_head and k == "lm_head.weight"))
    missing = sorted(expected - set(state_dict))
    problems = [f"missing {missing}"] if missing else []
    problems += [f"unexpected {unexpected}"] if unexpected else []
    for e in entries:
        if e.key in state_dict and tuple(state_dict[e.key].shape) != e.shape:
            problems.append(f"{e.key!r} has shape {tuple(state_dict[e.key].shape)}, the config says {e.shape}")
    if problems:
        raise ValueError(f"{family} state dict does not match its config (vocab={config.vocab}, embed={config.embed}, "
                         f"layers={config.layers}): " + "; ".join(problems) + ".")
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
    to_hf_model(config, params, **hf_overrides).save_pretrained(path)
    return path


def load_hf(path: str | Path, *, seq: int | None = None) -> tuple[GPTConfig, dict[str, np.ndarray]]:
    """``from_hf`` of a saved folder: config.json and safetensors weights (one file or an index
    of shards), read without building the model or unpickling anything."""
    import transformers
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} has no config.json; give a folder written by save_hf or save_pretrained.")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"{path} has no model.safetensors (or model.safetensors.index.json); parlay reads "
                         f"safetensors only, never pickled weights (pytorch_model.bin).")
    state = {}
    for f in files:
        state.update(load_file(path / f))
    return from_hf(transformers.AutoConfig.from_pretrained(path), state, seq=seq)


# -- parlay checkpoints <-> Hugging Face folders ----------------------------------------------------

def checkpoint_to_hf(checkpoint: str | Path, out: str | Path, **hf_overrides) -> Path:
    """A parlay checkpoint of a GPT (any backend, strategy or mesh) as a Hugging Face folder."""
    from .checkpoint import Checkpoint, CheckpointError

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
    yet), loadable into any backend, strategy and mesh."""
    from dataclasses import asdict

    from . import checkpoint
    from .core import Layout, Mesh, P
    from .core.optim import OptimizerConfig

    config, params = load_hf(folder, seq=seq)
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
