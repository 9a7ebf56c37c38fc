"""Sharded checkpoints: safetensors files plus a JSON manifest, the same on every backend.

A checkpoint is a folder ``step-00000100`` holding ``manifest.json`` and one
``rank-NNNNN.safetensors`` per mesh rank that owns a block. A tensor is stored in the layout it
had when saved: each distinct block once, by the first rank that holds it (replicas are not
written twice), under the key ``name@start0,start1,..``, with its SHA-256 in the file's header. The manifest lists every tensor's global
shape, dtype, layout and pieces (file, key, start, stop), and the run's state: format version,
model config, mesh, strategy, step, optimizer config, data position and seeds. No rank gathers
a whole tensor; a loader in any layout reads only the pieces its own block overlaps,
checks each against its SHA-256 and copies out the region it needs.

A save is written to ``step-00000100.tmp`` and committed by renaming the folder; older
checkpoints beyond ``keep_last`` are removed only after that. Loaders see committed folders only,
so a crash mid-save leaves the previous checkpoint as the newest. Nothing is unpickled: the
manifest is JSON, tensors are safetensors, and every field is checked before it is used; a bad
file is one ``CheckpointError`` naming the file and the field.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from .core.pieces import Piece, owned_blocks, pieces_of

__all__ = ["FORMAT", "VERSION", "CheckpointError", "Piece", "Checkpoint", "pieces_of", "owned_blocks",
           "write_file", "begin_save", "manifest_tensors", "save", "commit_save", "latest", "committed", "step_dir"]

FORMAT = "parlay-checkpoint"
VERSION = 2  # 2: the manifest's 'model' is {ref, describe, params} (1: a GPT's config)
DTYPES = {"float32": np.float32, "int32": np.int32, "int64": np.int64}
_DIR = re.compile(r"^step-(\d{8})$")
_FILE = re.compile(r"^rank-\d{5}\.safetensors$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: names the file and the field."""


# -- writing -------------------------------------------------------------------------------------

def _sha256(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def begin_save(root: str | os.PathLike, step: int) -> Path:
    """The temporary folder of step ``step``'s save (made empty). One process calls it; the
    others wait (a barrier) before writing their files."""
    tmp = step_dir(root, step).with_suffix(".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)  # a save that crashed earlier
    tmp.mkdir(parents=True)
    return tmp


def write_file(tmp: Path, file: str, tensors: Mapping[str, np.ndarray]) -> None:
    """One rank file's blocks, as ``{key: array}`` (keys from ``pieces_of``)."""
    from safetensors.numpy import save_file

    if not _FILE.match(file):
        raise ValueError(f"checkpoint file name {file!r} is not rank-NNNNN.safetensors.")
    bad = [k for k, v in tensors.items() if np.asarray(v).dtype != np.float32]
    if bad:
        raise ValueError(f"checkpoint: {bad[0]} is {np.asarray(tensors[bad[0]]).dtype}; checkpoints hold float32.")
    path = tmp / file
    part = path.with_suffix(".partial")
    tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    # Each block's SHA-256 lives in its own file's header, written by the rank that owns the bytes.
    save_file(tensors, str(part), metadata={k: _sha256(v) for k, v in tensors.items()})
    with open(part, "rb") as f:
        os.fsync(f.fileno())
    os.replace(part, path)


def manifest_tensors(tensors: Iterable[tuple[str, tuple, str, list[Piece]]], dtype: str = "float32") -> dict:
    return {name: {"shape": list(shape), "dtype": dtype, "layout": layout, "pieces": [p.to_json() for p in pieces]}
            for name, shape, layout, pieces in tensors}


def save(root: str | os.PathLike, step: int, tensors, blocks: Mapping[str, Mapping[str, np.ndarray]],
         meta: Mapping[str, Any], *, lead: bool = True, barrier=lambda: None, keep_last: int | None = None,
         crash_hook=None) -> None:
    """The whole save protocol; every process calls it with the blocks it owns. ``lead`` (one
    process) makes the temporary folder and commits; ``barrier`` waits for all processes."""
    if lead:
        begin_save(root, step)
    barrier()
    tmp = step_dir(root, step).with_suffix(".tmp")
    for file, data in blocks.items():
        write_file(tmp, file, data)
    barrier()
    if lead:
        commit_save(root, step, {**meta, "step": step, "tensors": manifest_tensors(tensors)}, keep_last=keep_last,
                    crash_hook=crash_hook)
    barrier()


def commit_save(root: str | os.PathLike, step: int, manifest: Mapping[str, Any], *, keep_last: int | None = None,
                crash_hook=None) -> Path:
    """Write the manifest, rename the folder into place, then prune (one process, after every
    rank's files are written). ``crash_hook(stage)`` is for tests that kill a save midway."""
    tmp, final = step_dir(root, step).with_suffix(".tmp"), step_dir(root, step)
    if crash_hook:
        crash_hook("before-manifest")
    data = json.dumps({"format": FORMAT, "version": VERSION, **manifest}, indent=1)
    with open(tmp / "manifest.json", "w") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    missing = sorted({p["file"] for t in manifest["tensors"].values() for p in t["pieces"]}
                     - {f.name for f in tmp.iterdir()})
    if missing:  # e.g. ranks on another node without a shared filesystem
        raise CheckpointError(f"{tmp}: {missing[0]} (and {len(missing) - 1} more) missing at commit; every rank must "
                              f"write into the same folder (a filesystem all ranks share)")
    _fsync_dir(tmp)
    if crash_hook:
        crash_hook("before-rename")
    if final.exists():  # the same step saved again (a resumed run): replace it
        old = final.with_suffix(".old")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)
    _fsync_dir(Path(root))
    if keep_last is not None:  # only older steps than the one just committed
        older = [p for p in committed(root) if int(_DIR.match(p.name).group(1)) < step]
        for old in older[:max(0, len(older) - (keep_last - 1))] if keep_last > 0 else []:
            gone = old.with_suffix(".del")
            os.rename(old, gone)  # out of `committed` at once, then deleted
            shutil.rmtree(gone)
    return final


def committed(root: str | os.PathLike) -> list[Path]:
    """Committed checkpoints under ``root``, oldest first (temporary folders are not listed)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _DIR.match(p.name) and (p / "manifest.json").is_file()]
    return sorted(found, key=lambda p: int(_DIR.match(p.name).group(1)))


def latest(root: str | os.PathLike) -> Path | None:
    found = committed(root)
    return found[-1] if found else None


# -- reading -------------------------------------------------------------------------------------

def _int_list(value, what: str, where: str, n: int | None = None) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise CheckpointError(f"{where}: {what} must be a list of non-negative ints, not {value!r:.80}")
    if n is not None and len(value) != n:
        raise CheckpointError(f"{where}: {what} has {len(value)} entries; the tensor has {n} dims")
    return tuple(value)


@dataclass
class TensorEntry:
    name: str
    shape: tuple[int, ...]
    dtype: str
    layout: str
    pieces: list[Piece]


class Checkpoint:
    """A committed checkpoint folder, its manifest checked field by field."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        mpath = self.path / "manifest.json"
        self._where = str(mpath)
        try:
            text = mpath.read_text()
        except FileNotFoundError:
            raise CheckpointError(f"{mpath}: missing; {self.path} is not a committed parlay checkpoint") from None
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{mpath}: cannot be read as text ({e})") from None
        try:
            m = json.loads(text)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{mpath}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
        if not isinstance(m, dict):
            raise CheckpointError(f"{mpath}: the manifest must be a JSON object, not {type(m).__name__}")
        if m.get("format") != FORMAT:
            raise CheckpointError(f"{mpath}: field 'format' is {m.get('format')!r}; a parlay checkpoint says {FORMAT!r}")
        if m.get("version") != VERSION:
            raise CheckpointError(f"{mpath}: field 'version' is {m.get('version')!r}; this parlay reads version {VERSION}")
        kinds = {int: "an integer", dict: "an object", str: "a string"}
        for key, kind in (("step", int), ("count", int), ("model", dict), ("mesh", dict), ("tensors", dict),
                          ("data", dict), ("optimizer", dict), ("strategy", str)):
            if not isinstance(m.get(key), kind) or isinstance(m.get(key), bool):
                raise CheckpointError(f"{mpath}: field {key!r} must be {kinds[kind]}, not {m.get(key)!r:.80}")
        self.manifest = m
        self.step: int = m["step"]
        self.tensors: dict[str, TensorEntry] = {name: self._entry(name, t) for name, t in m["tensors"].items()}
        self._files: dict[str, Any] = {}
        self._verified: set = set()  # (file, key) whose bytes matched their SHA-256

    def _entry(self, name: str, t) -> TensorEntry:
        where = f"{self._where}: tensor {name!r}"
        if not isinstance(t, dict):
            raise CheckpointError(f"{where} must be an object")
        shape = _int_list(t.get("shape"), "field 'shape'", where)
        if t.get("dtype") not in DTYPES:
            raise CheckpointError(f"{where}: field 'dtype' is {t.get('dtype')!r}; expected one of {', '.join(DTYPES)}")
        if not isinstance(t.get("layout"), str):
            raise CheckpointError(f"{where}: field 'layout' must be a string")
        if not isinstance(t.get("pieces"), list) or not t["pieces"]:
            raise CheckpointError(f"{where}: field 'pieces' must be a non-empty list")
        pieces = []
        for i, p in enumerate(t["pieces"]):
            pw = f"{where}, piece {i}"
            if not isinstance(p, dict):
                raise CheckpointError(f"{pw} must be an object")
            if not isinstance(p.get("file"), str) or not _FILE.match(p["file"]):
                raise CheckpointError(f"{pw}: field 'file' is {p.get('file')!r}; pieces live in rank-NNNNN.safetensors "
                                      f"files inside the checkpoint folder")
            if not isinstance(p.get("key"), str):
                raise CheckpointError(f"{pw}: field 'key' must be a string")
            start = _int_list(p.get("start"), "field 'start'", pw, len(shape))
            stop = _int_list(p.get("stop"), "field 'stop'", pw, len(shape))
            if any(a >= b or b > n for a, b, n in zip(start, stop, shape)):
                raise CheckpointError(f"{pw}: the block {start}..{stop} is empty or outside the shape {shape}")
            pieces.append(Piece(p["file"], p["key"], start, stop))
        volume = sum(math.prod(b - a for a, b in zip(p.start, p.stop)) for p in pieces)
        if volume != math.prod(shape) or not _tiles(pieces, shape):
            raise CheckpointError(f"{where}: its pieces do not tile the shape {shape} exactly once")
        return TensorEntry(name, shape, t["dtype"], t["layout"], pieces)

    def _open(self, file: str):
        from safetensors import safe_open

        if file not in self._files:
            path = self.path / file
            try:
                self._files[file] = safe_open(str(path), framework="numpy")
            except FileNotFoundError:
                raise CheckpointError(f"{path}: missing (the manifest lists pieces in it)") from None
            except Exception as e:  # safetensors' own error for truncated or malformed files
                raise CheckpointError(f"{path}: not a readable safetensors file ({str(e).splitlines()[0]})") from None
        return self._files[file]

    def open_all(self) -> None:
        """Open every tensor file the manifest names (their headers are checked now, not mid-run)."""
        for file in sorted({p.file for e in self.tensors.values() for p in e.pieces}):
            self._open(file)

    def entry(self, name: str, shape: Sequence[int] | None = None) -> TensorEntry:
        if name not in self.tensors:
            raise CheckpointError(f"{self._where}: no tensor {name!r} (the checkpoint holds {len(self.tensors)} tensors)")
        e = self.tensors[name]
        if shape is not None and tuple(shape) != e.shape:
            raise CheckpointError(f"{self._where}: tensor {name!r} has shape {e.shape}; the model expects {tuple(shape)}")
        return e

    def read(self, name: str, region: Sequence[slice] | None = None, *, shape: Sequence[int] | None = None) -> np.ndarray:
        """The region ``region`` (slices with explicit start/stop; default: all) of tensor ``name``,
        read from the pieces it overlaps only, each checked against its SHA-256."""
        e = self.entry(name, shape)
        region = tuple(region) if region is not None else tuple(slice(0, n) for n in e.shape)
        if len(region) != len(e.shape):
            raise ValueError(f"read {name!r}: {len(region)} slices for a tensor of {len(e.shape)} dims")
        lo = [0 if s.start is None else s.start for s in region]
        hi = [n if s.stop is None else s.stop for s, n in zip(region, e.shape)]
        if any(s.step not in (None, 1) or not 0 <= a < b <= n for s, a, b, n in zip(region, lo, hi, e.shape)):
            raise ValueError(f"read {name!r}: region {region} is not a non-empty box inside the shape {e.shape}")
        out = np.empty([b - a for a, b in zip(lo, hi)], DTYPES[e.dtype])
        for p in e.pieces:
            a = [max(x, y) for x, y in zip(lo, p.start)]
            b = [min(x, y) for x, y in zip(hi, p.stop)]
            if any(x >= y for x, y in zip(a, b)):
                continue
            f = self._open(p.file)
            path = self.path / p.file
            if p.key not in f.keys():
                raise CheckpointError(f"{path}: no tensor {p.key!r} (the manifest's piece of {name!r})")
            sl = f.get_slice(p.key)
            want = [y - x for x, y in zip(p.start, p.stop)]
            if list(sl.get_shape()) != want or sl.get_dtype() != _ST_DTYPES[e.dtype]:
                raise CheckpointError(f"{path}: tensor {p.key!r} is {sl.get_dtype()} {sl.get_shape()}; the manifest "
                                      f"says {_ST_DTYPES[e.dtype]} {want}")
            if (p.file, p.key) not in self._verified:  # once per piece: read it whole and hash it
                digest = (f.metadata() or {}).get(p.key)
                if digest is None:
                    raise CheckpointError(f"{path}: no SHA-256 for tensor {p.key!r} in the file's header")
                if _sha256(f.get_tensor(p.key)) != digest:
                    raise CheckpointError(f"{path}: tensor {p.key!r} does not match its SHA-256 (the file is corrupted)")
                self._verified.add((p.file, p.key))
            block = sl[tuple(slice(x - s, y - s) for x, y, s in zip(a, b, p.start))]
            out[tuple(slice(x - l, y - l) for x, y, l in zip(a, b, lo))] = block
        return out

    def meta(self, key: str) -> Any:
        return self.manifest[key]

    def count(self) -> int:
        """The number of optimizer updates the checkpoint's state has taken."""
        count = self.manifest.get("count")
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise CheckpointError(f"{self._where}: field 'count' must be a non-negative int, not {count!r}")
        return count


_ST_DTYPES = {"float32": "F32", "int32": "I32", "int64": "I64"}


def _tiles(pieces: Iterable[Piece], shape: Sequence[int]) -> bool:
    """Pieces cover the shape exactly once: each cell of the grid their boundaries make is in one piece."""
    pieces = list(pieces)
    cuts = [sorted({0, n} | {p.start[d] for p in pieces} | {p.stop[d] for p in pieces}) for d, n in enumerate(shape)]
    if math.prod(len(c) - 1 for c in cuts) > 1_000_000:
        return False
    seen: dict = {}
    for p in pieces:
        ranges = [range(c.index(a), c.index(b)) for c, a, b in zip(cuts, p.start, p.stop)]
        for cell in np.ndindex(*[len(r) for r in ranges]):
            key = tuple(r[i] for r, i in zip(ranges, cell))
            if key in seen:
                return False
            seen[key] = True
    return len(seen) == math.prod(len(c) - 1 for c in cuts)
