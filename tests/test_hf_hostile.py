"""import-hf and export-hf on hostile input: every bad folder, file, config field, step or output
path is refused with status 2 and one line "parlay: ..." naming what was given, the rule and the
fix; nothing is written, nothing outside the folder is read, and no checkpoint is replaced."""

import json
import math
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_hf import _hf_model

from parlay import hf
from parlay.checkpoint import Checkpoint, committed
from parlay.cli import main
from parlay.hf import from_hf, load_hf, save_hf


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A LLaMA (GQA) and a GPT-2 Hugging Face folder, and a parlay checkpoint of the LLaMA."""
    root = tmp_path_factory.mktemp("hf")
    out = {name: save_hf(root / name, *from_hf(_hf_model(case, 1))) for name, case in
           [("llama", "llama-gqa"), ("gpt2", "gpt2")]}
    out["ckpt"] = hf.hf_to_checkpoint(out["llama"], root / "ckpt", step=3)
    return out


@pytest.fixture
def llama(folders, tmp_path):
    return shutil.copytree(folders["llama"], tmp_path / "model")


def _refused(capsys, argv, match):
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("parlay: "), err
    assert match in err, err
    return err


def _import_refused(capsys, folder, match, *flags):
    out = folder.parent / "out"
    _refused(capsys, ["import-hf", folder, out, *flags], match)
    assert not out.exists() or not any(out.iterdir()), "a refused import wrote something"


def _config(d, drop=(), **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg = {k: v for k, v in {**cfg, **changes}.items() if k not in drop}
    (d / "config.json").write_text(json.dumps(cfg))


def _tensors(d, drop=(), put=None):
    state = {**load_file(d / "model.safetensors"), **(put or {})}
    save_file({k: v for k, v in state.items() if k not in drop}, d / "model.safetensors")


def _shard(d):
    """model.safetensors split in two files and an index (what save_pretrained writes for big models)."""
    state = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    keys = sorted(state)
    files = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for f, ks in files.items():
        save_file({k: state[k] for k in ks}, d / f)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: f for f, ks in files.items()
                                                                               for k in ks}}))


def _index(d, weight_map):
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


CONFIGS = [  # (config.json changes, message)
    ({"hidden_size": "64"}, "config.json: hidden_size='64' must be an int from 1 to 2147483647"),
    ({"num_hidden_layers": True}, "num_hidden_layers=True must be an int from 1 to 4096"),
    ({"vocab_size": [96]}, "vocab_size=[96] must be an int"),
    ({"vocab_size": 96.0}, "vocab_size=96.0 must be an int"),
    ({"vocab_size": 0}, "vocab_size=0 must be an int from 1"),
    ({"hidden_size": -64}, "hidden_size=-64 must be an int from 1"),
    ({"num_attention_heads": 0}, "num_attention_heads=0 must be an int from 1"),
    ({"intermediate_size": None}, "intermediate_size=None must be an int"),
    ({"max_position_embeddings": 0}, "max_position_embeddings=0 must be an int"),
    ({"head_dim": 0}, "head_dim=0 must be an int"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers=1000000000 must be an int from 1 to 4096"),
    ({"vocab_size": 10**12}, "vocab_size=1000000000000 must be an int from 1 to 2147483647"),
    ({"rms_norm_eps": math.nan}, "rms_norm_eps=nan must be a finite number between 0 and 1"),
    ({"rms_norm_eps": math.inf}, "rms_norm_eps=inf must be a finite number between 0 and 1"),
    ({"rms_norm_eps": -1e-5}, "rms_norm_eps=-1e-05 must be a finite number"),
    ({"rms_norm_eps": 0}, "rms_norm_eps=0 must be a finite number"),
    ({"rms_norm_eps": "1e-5"}, "rms_norm_eps='1e-5' must be a finite number"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": math.nan}},
     "rope_parameters['rope_theta']=nan must be a finite positive number"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 0}}, "rope_parameters['rope_theta']=0 must be"),
    ({"rope_theta": -5.0}, "rope_theta=-5.0 must be a finite positive number"),
    ({"rope_parameters": [10000.0]}, "rope_parameters=[10000.0] must be a dict or null"),
    ({"attention_bias": "no"}, "attention_bias='no' must be a bool"),
    ({"tie_word_embeddings": 0}, "tie_word_embeddings=0 must be a bool"),
    ({"hidden_act": ["silu"]}, "hidden_act=['silu'] must be a str"),
    ({"model_type": "bert"}, "config.json: model_type='bert': parlay imports 'gpt2' and 'llama' models"),
    ({"model_type": "nonsense"}, "model_type='nonsense': parlay imports"),
    ({"model_type": None}, "model_type=None: parlay imports"),
    ({"architectures": ["LlamaForSequenceClassification"]},
     "architectures=['LlamaForSequenceClassification']: parlay imports LlamaForCausalLM"),
    ({"architectures": "LlamaForCausalLM"}, "architectures='LlamaForCausalLM': parlay imports LlamaForCausalLM"),
    ({"use_cache": "maybe"}, "config.json: transformers refuses it (Validation error for field 'use_cache'"),
    ({"num_hidden_layers": 3}, "num_hidden_layers=3 but the tensors hold 2 layers; the config's layer count must"),
    ({"vocab_size": 10**6}, "'model.embed_tokens.weight' has shape (96, 64), the config says (1000000, 64)"),
]


@pytest.mark.parametrize("changes, message", CONFIGS, ids=[str(c)[:40] for c, _ in CONFIGS])
def test_bad_config_fields_are_refused_before_any_tensor_is_read(llama, capsys, monkeypatch, changes, message):
    def no_read(*a, **k):
        raise AssertionError("tensor data read before the config was checked")

    monkeypatch.setattr("safetensors.torch.load_file", no_read)
    _config(llama, **changes)
    _import_refused(capsys, llama, message)


@pytest.mark.parametrize("changes, message", [
    ({"layer_norm_epsilon": math.nan}, "layer_norm_epsilon=nan must be a finite number between 0 and 1"),
    ({"n_layer": -1}, "n_layer=-1 must be an int from 1 to 4096"),
    ({"n_inner": "96"}, "n_inner='96' must be an int"),
    ({"scale_attn_weights": "false"}, "scale_attn_weights='false' must be a bool"),
])
def test_bad_gpt2_config_fields(folders, tmp_path, capsys, changes, message):
    d = shutil.copytree(folders["gpt2"], tmp_path / "model")
    _config(d, **changes)
    _import_refused(capsys, d, message)


def _not_json(d):
    (d / "config.json").write_text("{not json")


def _too_deep(d):
    (d / "config.json").write_text("[" * 100_000 + "]" * 100_000)


def _no_model_type(d):
    _config(d, drop=("model_type",))


def _truncated(d):
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:len(data) // 2])


def _loop(d):
    (d / "model.safetensors").unlink()
    os.symlink("model.safetensors", d / "model.safetensors")


def _fifo(d):
    (d / "model.safetensors").unlink()
    os.mkfifo(d / "model.safetensors")  # opening it would block forever


def _dir(d):
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").mkdir()


def _outside(d, name="x.safetensors"):
    """model.safetensors moved next to the folder (a valid file, but outside)."""
    shutil.move(d / "model.safetensors", d.parent / name)
    return d.parent / name


def _duplicated(d):
    _shard(d)
    save_file(load_file(d / "model-00001-of-00002.safetensors"), d / "model-00003-of-00003.safetensors")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["extra"] = "model-00003-of-00003.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


FOLDERS = {  # name: (what is done to a good folder, message)
    "no config.json": (lambda d: (d / "config.json").unlink(), "has no config.json; give a folder written by save_hf"),
    "config.json not JSON": (_not_json, "config.json is not valid JSON (Expecting property name"),
    "config.json not UTF-8": (lambda d: (d / "config.json").write_bytes(b"\xff\xfe\xfa{"), "is not valid JSON"),
    "config.json nested too deep": (_too_deep, "config.json is not valid JSON ("),
    "config.json a list": (lambda d: (d / "config.json").write_text("[1, 2]"), "holds a JSON list, not an object"),
    "config.json a folder": (lambda d: ((d / "config.json").unlink(), (d / "config.json").mkdir()),
                             "config.json is not a regular file (a folder, pipe or device)"),
    "no model_type": (_no_model_type, "model_type=None: parlay imports 'gpt2' and 'llama' models"),
    "no safetensors": (lambda d: (d / "model.safetensors").unlink(), "has no model.safetensors (or model.safetensors"
                                                                     ".index.json); parlay reads safetensors only"),
    "truncated safetensors": (_truncated, "model.safetensors is not a valid safetensors file (Error while "
                                          "deserializing header: incomplete metadata"),
    "garbage safetensors": (lambda d: (d / "model.safetensors").write_bytes(np.random.default_rng(0).bytes(999)),
                            "model.safetensors is not a valid safetensors file"),
    "huge header length": (lambda d: (d / "model.safetensors").write_bytes(b"\xff" * 8 + b"{}"),
                           "header too large"),
    "empty safetensors": (lambda d: (d / "model.safetensors").write_bytes(b""), "not a valid safetensors file"),
    "safetensors a symlink loop": (_loop, "model.safetensors cannot be resolved ("),
    "safetensors a FIFO": (_fifo, "model.safetensors is not a regular file"),
    "safetensors a folder": (_dir, "model.safetensors is not a regular file"),
    "wrong shape": (lambda d: _tensors(d, put={"model.norm.weight": torch.zeros(3)}),
                    "'model.norm.weight' has shape (3,), the config says (64,)"),
    "int dtype": (lambda d: _tensors(d, put={"model.norm.weight": torch.zeros(64, dtype=torch.int32)}),
                  "tensor 'model.norm.weight' is I32; parlay reads F32, BF16, F16 (float32 holds them exactly)"),
    "float64 (rounded in float32)": (lambda d: _tensors(d, put={"model.norm.weight": torch.zeros(64).double()}),
                                     "tensor 'model.norm.weight' is F64; parlay reads F32, BF16, F16"),
    "missing tensor": (lambda d: _tensors(d, drop=("model.norm.weight",)), "missing ['model.norm.weight']"),
    "extra tensor": (lambda d: _tensors(d, put={"extra": torch.zeros(2)}), "unexpected ['extra']"),
    "a layer short": (lambda d: _tensors(d, drop=[k for k in load_file(d / "model.safetensors") if ".layers.1." in k]),
                      "num_hidden_layers=2 but the tensors hold 1 layer;"),
    "index not JSON": (lambda d: (d / "model.safetensors.index.json").write_text("{bad"),
                       "model.safetensors.index.json is not valid JSON"),
    "index a list": (lambda d: (d / "model.safetensors.index.json").write_text("[]"), "holds a JSON list, not an "
                                                                                     "object; give the safetensors index"),
    "index without weight_map": (lambda d: (d / "model.safetensors.index.json").write_text("{}"),
                                 "'weight_map' must be an object of tensor name -> file name, not None"),
    "weight_map a list": (lambda d: (d / "model.safetensors.index.json").write_text('{"weight_map": ["a"]}'),
                          "'weight_map' must be an object of tensor name -> file name, not ['a']"),
    "weight_map to a number": (lambda d: _index(d, {"a": 3}), "not {'a': 3}"),
    "weight_map to a pickle": (lambda d: _index(d, {"a": "pytorch_model.bin"}),
                               "weight_map names 'pytorch_model.bin'; parlay reads .safetensors files only"),
    "weight_map to a missing file": (lambda d: _index(d, {"a": "nope.safetensors"}),
                                     "nope.safetensors does not exist (model.safetensors.index.json's weight_map "
                                     "names it)"),
    "weight_map to ../": (lambda d: (_outside(d), _index(d, {"a": "../x.safetensors"})),
                          "weight_map names '../x.safetensors'; parlay reads only files directly inside"),
    "weight_map to an absolute path": (lambda d: _index(d, {"a": str(_outside(d))}),
                                       "x.safetensors'; parlay reads only files directly inside"),
    "weight_map to a subfolder": (lambda d: ((d / "sub").mkdir(), shutil.move(d / "model.safetensors", d / "sub"),
                                             _index(d, {"a": "sub/model.safetensors"})),
                                  "names 'sub/model.safetensors'; parlay reads only files directly inside"),
    "weight_map to a symlink out": (lambda d: (os.symlink(_outside(d), d / "w.safetensors"),
                                               _index(d, {"a": "w.safetensors"})),
                                    "w.safetensors resolves to"),
    "safetensors a symlink out": (lambda d: os.symlink(_outside(d), d / "model.safetensors"),
                                  "outside"),
    "config.json a symlink out": (lambda d: (shutil.move(d / "config.json", d.parent / "c.json"),
                                             os.symlink(d.parent / "c.json", d / "config.json")),
                                  "config.json resolves to"),
    "a tensor in two shards": (_duplicated, "is in both model-00001-of-00002.safetensors and "
                                            "model-00003-of-00003.safetensors; a tensor lives in one file"),
}


@pytest.mark.parametrize("name", list(FOLDERS))
def test_hostile_folders_are_refused_in_one_line(llama, capsys, name):
    spoil, message = FOLDERS[name]
    spoil(llama)
    _import_refused(capsys, llama, message)


def test_files_outside_the_folder_are_never_opened(llama, capsys, monkeypatch):
    """A symlink out is refused before it is read: the file it names is never opened."""
    target = _outside(llama)
    os.symlink(target, llama / "model.safetensors")
    opened = []
    real = hf._headers
    monkeypatch.setattr(hf, "_headers", lambda files: opened.extend(files) or real(files))
    _refused(capsys, ["import-hf", llama, llama.parent / "out"],
             f"resolves to {target}, outside {llama}; parlay reads only files directly inside the folder: copy the "
             f"file in (cp -L)")
    assert opened == []


def test_links_inside_the_folder_and_shards_still_import(llama, tmp_path):
    want_config, want = load_hf(llama)
    (llama / "model.safetensors").rename(llama / "weights.safetensors")
    os.symlink("weights.safetensors", llama / "model.safetensors")  # to a file in the same folder: fine
    os.symlink(llama, tmp_path / "link")  # the folder itself through a link: fine
    assert main(["import-hf", str(tmp_path / "link"), str(tmp_path / "a")]) == 0
    (llama / "model.safetensors").unlink()
    (llama / "weights.safetensors").rename(llama / "model.safetensors")
    _shard(llama)
    config, got = load_hf(llama)
    assert config == want_config and all(np.array_equal(got[k], want[k]) for k in want)


def test_the_size_limit_is_checked_from_the_headers(llama, capsys, monkeypatch):
    count = sum(v.size for v in load_hf(llama)[1].values())
    monkeypatch.setattr(hf, "MAX_PARAMS", count - 1)
    monkeypatch.setattr("safetensors.torch.load_file", lambda *a, **k: pytest.fail("tensor data read"))
    _import_refused(capsys, llama, f"holds {count:,} parameters, over parlay's import limit of {count - 1:,} (an "
                                   f"import holds them as float32 with two AdamW moments in memory)")


def test_an_oversized_config_json_is_not_read(llama, capsys, monkeypatch):
    monkeypatch.setattr(hf, "_MAX_JSON", 100)
    size = (llama / "config.json").stat().st_size
    _import_refused(capsys, llama, f"config.json is {size} bytes, over parlay's 100 for a model config")


def test_in_memory_configs_are_checked_too():
    model = _hf_model("llama-gqa", 2)
    model.config.rms_norm_eps = math.nan
    with pytest.raises(ValueError, match=r"this llama config: rms_norm_eps=nan must be a finite number"):
        from_hf(model)
    model.config.rms_norm_eps, model.config.num_hidden_layers = 1e-6, 10**9
    with pytest.raises(ValueError, match=r"num_hidden_layers=1000000000 must be an int from 1 to 4096"):
        from_hf(model)
    model.config.num_hidden_layers = 3  # more layers than the state dict holds: refused before listing them
    with pytest.raises(ValueError, match=r"num_hidden_layers=3 but the tensors hold 2 layers"):
        from_hf(model)


# -- where the checkpoint goes ----------------------------------------------------------------------

def test_import_never_replaces_a_checkpoint(folders, capsys):
    ckpt = folders["ckpt"]
    before = (ckpt / "manifest.json").read_bytes()
    _refused(capsys, ["import-hf", folders["llama"], ckpt.parent, "--step", "3"],
             f"{ckpt} holds a committed checkpoint; import-hf never replaces it: give another --step or another "
             f"folder")
    assert (ckpt / "manifest.json").read_bytes() == before
    (ckpt.parent / "step-00000004").mkdir()  # not a checkpoint, but in the way
    _refused(capsys, ["import-hf", folders["llama"], ckpt.parent, "--step", "4"], "step-00000004 holds something")
    (ckpt.parent / "step-00000004").rmdir()


def test_a_negative_step_is_refused(folders, tmp_path, capsys):
    _refused(capsys, ["import-hf", folders["llama"], tmp_path / "c", "--step", "-1"],
             "step -1 is negative: checkpoint folders are step-NNNNNNNN, a count of updates from 0")
    assert not (tmp_path / "c").exists()


def test_steps_past_eight_digits_are_found_by_resume(folders, tmp_path):
    assert main(["import-hf", str(folders["llama"]), str(tmp_path / "c"), "--step", "99999999"]) == 0
    assert main(["import-hf", str(folders["llama"]), str(tmp_path / "c"), "--step", "123456789"]) == 0
    assert [p.name for p in committed(tmp_path / "c")] == ["step-99999999", "step-123456789"]
    assert Checkpoint(tmp_path / "c" / "step-99999999").meta("count") == 0


def test_import_into_a_file_is_refused(folders, tmp_path, capsys):
    (tmp_path / "f").write_text("mine")
    _refused(capsys, ["import-hf", folders["llama"], tmp_path / "f"],
             f"{tmp_path / 'f'} exists and is not a folder; checkpoints are written into a folder")
    _refused(capsys, ["import-hf", folders["llama"], tmp_path / "f" / "c"],
             f"{tmp_path / 'f'} exists and is not a folder, so {tmp_path / 'f' / 'c'} cannot be made")
    _refused(capsys, ["import-hf", tmp_path / "f", tmp_path / "c"], "f is not a folder; give a folder written by")
    _refused(capsys, ["import-hf", tmp_path / "nope", tmp_path / "c"], "nope does not exist; give a folder")
    assert (tmp_path / "f").read_text() == "mine"


# -- export -----------------------------------------------------------------------------------------

def test_export_onto_a_file_or_a_model_is_refused(folders, tmp_path, capsys):
    ckpt = folders["ckpt"]
    (tmp_path / "f").write_text("mine")
    _refused(capsys, ["export-hf", ckpt, tmp_path / "f"],
             f"{tmp_path / 'f'} exists and is not a folder; a Hugging Face model is a folder (config.json + "
             f"model.safetensors): give a folder path")
    _refused(capsys, ["export-hf", ckpt, tmp_path / "f" / "out"], "cannot be made")
    assert (tmp_path / "f").read_text() == "mine"
    (tmp_path / "empty").mkdir()  # an empty folder is fine
    assert main(["export-hf", str(ckpt), str(tmp_path / "empty")]) == 0
    capsys.readouterr()  # its progress bar
    before = (tmp_path / "empty" / "model.safetensors").read_bytes()
    _refused(capsys, ["export-hf", ckpt, tmp_path / "empty"],
             "empty already holds ['config.json', 'generation_config.json', 'model.safetensors']; export-hf never "
             "overwrites a model: remove them or choose another folder")
    assert (tmp_path / "empty" / "model.safetensors").read_bytes() == before
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).mkdir()
        (tmp_path / name / name).write_text("{}")
        _refused(capsys, ["export-hf", ckpt, tmp_path / name], f"already holds ['{name}']; export-hf never "
                                                               f"overwrites a model: remove it")


def test_import_into_a_folder_a_run_is_writing_is_refused(folders, tmp_path, capsys):
    import subprocess
    import sys

    held = tmp_path / "ck"
    holder = subprocess.Popen([sys.executable, "-c", "import time; from parlay.checkpoint import locked\n"
                               f"with locked({str(held)!r}):\n    print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        _refused(capsys, ["import-hf", folders["llama"], held, "--step", "5"],
                 f"{held}: another run is writing checkpoints here (pid {holder.pid} on ")
    finally:
        holder.kill()
        holder.wait()
    assert committed(held) == []
