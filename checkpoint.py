"""Sharded checkpoints: safetensors files plus a JSON manifest, the same on every backend.

A checkpoint is a folder ``step-00000100`` holding ``manifest.json`` and one
``rank-NNNNN.safetensors`` per mesh rank that owns a block. A tensor is stored in the layout it
had when saved: each distinct block once, by the first rank that holds it (replicas are not
written twice), under the key ``name@start0,start1,..``. Each file's header is stamped with the
run, step and file name that wrote it. The manifest lists every tensor's global shape, dtype,
layout and pieces (file, key, start, stop, SHA-256), and the run's state: format version, the
run's id, model, mesh, strategy, step, optimizer config, data (files and their SHA-256) and
seeds. No rank gathers a whole tensor; a loader in any layout reads only the pieces its own block
overlaps, checks each against the manifest's SHA-256 and copies out the region it needs; a file
stamped by another run, step or rank is refused when opened, so no file from elsewhere passes.

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
import socket
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from .core.pieces import Piece, owned_blocks, pieces_of

__all__ = ["FORMAT", "VERSION", "CheckpointError", "Piece", "Checkpoint", "pieces_of", "owned_blocks",
           "write_file", "begin_save", "manifest_tensors", "save", "commit_save", "latest", "committed", "step_dir", "locked", "FolderLocked", "LOCK_FILE"]

FORMAT = "parlay-checkpoint"
VERSION = 3  # 3: every piece's SHA-256 and the run's identity in the manifest, each file stamped
# (2: the manifest's 'model' is {ref, describe, params}; 1: a GPT's config)
STAMP = "__parlay__"  # a rank file's header entry: which run, step and file wrote it
DTYPES = {"float32": np.float32, "int32": np.int32, "int64": np.int64}
_DIR = re.compile(r"^step-(\d{8,})$")  # step_dir pads to 8 digits; later steps have more
_FILE = re.compile(r"^rank-\d{5}\.safetensors$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: names the file and the field."""


class FolderLocked(CheckpointError):
    """Another live run holds the checkpoint folder."""


# -- one run per folder ------------------------------------------------------------------------------

LOCK_FILE = ".parlay-lock"
_held: dict[str, list] = {}  # folder -> [open lock file, depth]: re-entrant within a process


@contextmanager
def locked(root: str | os.PathLike):
    """Hold ``root``'s exclusive lock while a run writes checkpoints into it.

    An ``flock`` on ``root/.parlay-lock``: the kernel releases it when the holder exits in any way
    (SIGKILL included), so a lock file left by a dead run is stale by construction and is taken
    over; the file says who holds it (pid, host, start, command) for the refusal. A second run
    gets ``FolderLocked`` naming the holder. Re-entrant within one process.
    """
    import fcntl

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    key = str(root.resolve())
    if key in _held:
        _held[key][1] += 1
        try:
            yield
        finally:
            _held[key][1] -= 1
        return
    path = root / LOCK_FILE
    try:
        f = open(path, "a+")
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be opened as parlay's lock file ({e.strerror}); remove it") from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "a process that has not written its name yet"
        f.close()
        raise FolderLocked(f"{root}: another run is writing checkpoints here ({holder}); wait for it to end, or "
                           f"give another folder") from None
    except OSError as e:
        f.close()
        raise CheckpointError(f"{path}: cannot be locked ({e.strerror}); put checkpoints on a filesystem with "
                              f"file locks") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}: "
            f"{' '.join(sys.argv)[:200]}\n")
    f.flush()
    _held[key] = [f, 1]
    try:
        yield
    finally:
        _held[key][1] -= 1
        if not _held[key][1]:
            del _held[key]
            f.truncate(0)  # the holder's name goes with the lock
            f.close()


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


def write_file(tmp: Path, file: str, tensors: Mapping[str, np.ndarray], *, run: str, step: int) -> None:
    """One rank file's blocks, as ``{key: array}`` (keys from ``pieces_of``), stamped with the
    run and step that wrote it."""
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
    stamp = json.dumps({"run": run, "step": step, "file": file})
    try:
        save_file(tensors, str(part), metadata={STAMP: stamp, **{k: _sha256(v) for k, v in tensors.items()}})
    except Exception as e:  # safetensors' error for a full disk or an unwritable folder
        raise CheckpointError(f"{path}: cannot be written ({str(e).splitlines()[0]}); the checkpoint of step {step} "
                              f"was not committed (free space, or choose another --checkpoint-dir)") from None
    with open(part, "rb") as f:
        os.fsync(f.fileno())
    os.replace(part, path)


def manifest_tensors(tensors: Iterable[tuple[str, tuple, str, list[Piece]]], dtype: str = "float32") -> dict:
    return {name: {"shape": list(shape), "dtype": dtype, "layout": layout, "pieces": [p.to_json() for p in pieces]}
            for name, shape, layout, pieces in tensors}


def save(root: str | os.PathLike, step: int, tensors, blocks: Mapping[str, Mapping[str, np.ndarray]],
         meta: Mapping[str, Any], *, run: str | None = None, lead: bool = True, barrier=lambda: None,
         keep_last: int | None = None, crash_hook=None) -> None:
    """The whole save protocol; every process calls it with the blocks it owns. ``lead`` (one
    process) makes the temporary folder and commits; ``barrier`` waits for all processes.
    ``run``: the run's identity, the same in every process (default: a new one, for a save by
    one process)."""
    run = run or new_run_id()  # different ids in different processes fail the commit's stamp check
    if lead:
        begin_save(root, step)
    barrier()
    tmp = step_dir(root, step).with_suffix(".tmp")
    for file, data in blocks.items():
        write_file(tmp, file, data, run=run, step=step)
    barrier()
    if lead:
        commit_save(root, step, {**meta, "step": step, "run": {"id": run}, "tensors": manifest_tensors(tensors)},
                    keep_last=keep_last, crash_hook=crash_hook)
    barrier()


def new_run_id() -> str:
    import uuid

    return uuid.uuid4().hex


def commit_save(root: str | os.PathLike, step: int, manifest: Mapping[str, Any], *, keep_last: int | None = None,
                crash_hook=None) -> Path:
    """Copy every piece's SHA-256 from its file's header into the manifest (each file stamped by
    this run at this step), write the manifest, rename the folder into place, then prune (one
    process, after every rank's files are written). ``crash_hook(stage)`` is for tests that kill
    a save midway."""
    tmp, final = step_dir(root, step).with_suffix(".tmp"), step_dir(root, step)
    if crash_hook:
        crash_hook("before-manifest")
    manifest = _with_digests(tmp, step, manifest)
    data = json.dumps({"format": FORMAT, "version": VERSION, **manifest}, indent=1)
    with open(tmp / "manifest.json", "w") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
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


def _with_digests(tmp: Path, step: int, manifest: Mapping[str, Any]) -> dict:
    from safetensors import safe_open

    files = sorted({p["file"] for t in manifest["tensors"].values() for p in t["pieces"]})
    missing = [f for f in files if not (tmp / f).is_file()]
    if missing:  # e.g. ranks on another node without a shared filesystem
        raise CheckpointError(f"{tmp}: {missing[0]} (and {len(missing) - 1} more) missing at commit; every rank must "
                              f"write into the same folder (a filesystem all ranks share)")
    want = {"run": manifest["run"]["id"], "step": step}
    headers = {}
    for file in files:
        with safe_open(str(tmp / file), framework="numpy") as f:
            headers[file] = f.metadata() or {}
        stamp = _stamp(headers[file])
        if stamp != {**want, "file": file}:
            raise CheckpointError(f"{tmp / file}: stamped {stamp}, not by this save ({want}); two runs wrote into "
                                  f"one folder")
    tensors = {name: {**t, "pieces": [{**p, "sha256": headers[p["file"]].get(p["key"])} for p in t["pieces"]]}
               for name, t in manifest["tensors"].items()}
    absent = [(p["file"], p["key"]) for t in tensors.values() for p in t["pieces"] if p["sha256"] is None]
    if absent:
        raise CheckpointError(f"{tmp / absent[0][0]}: no block {absent[0][1]!r} at commit (the rank that owns it did "
                              f"not write it)")
    return {**manifest, "tensors": tensors}


def _stamp(header: Mapping[str, str]):
    try:
        return json.loads(header.get(STAMP, "null"))
    except json.JSONDecodeError:
        return None


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
        if mpath.exists() and not mpath.is_file():  # a FIFO would block the read for good
            raise CheckpointError(f"{mpath}: not a regular file; {self.path} is not a committed parlay checkpoint")
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
        except RecursionError:
            raise CheckpointError(f"{mpath}: nested too deeply to be a parlay manifest") from None
        if not isinstance(m, dict):
            raise CheckpointError(f"{mpath}: the manifest must be a JSON object, not {type(m).__name__}")
        if m.get("format") != FORMAT:
            raise CheckpointError(f"{mpath}: field 'format' is {m.get('format')!r}; a parlay checkpoint says {FORMAT!r}")
        if m.get("version") != VERSION:
            raise CheckpointError(f"{mpath}: field 'version' is {m.get('version')!r}; this parlay reads version {VERSION}")
        kinds = {int: "an integer", dict: "an object", str: "a string"}
        for key, kind in (("step", int), ("count", int), ("model", dict), ("mesh", dict), ("tensors", dict),
                          ("data", dict), ("optimizer", dict), ("strategy", str), ("run", dict), ("losses", list),
                          ("evals", list)):
            if not isinstance(m.get(key), kind) or isinstance(m.get(key), bool):
                raise CheckpointError(f"{mpath}: field {key!r} must be {kinds.get(kind, 'a list')}, not "
                                      f"{m.get(key)!r:.80}")
        _check_state(m, self.path, str(mpath))
        self.manifest = m
        self.step: int = m["step"]
        self.run: str = m["run"]["id"]
        self._digests: dict[tuple[str, str], str] = {}  # (file, key) -> the manifest's SHA-256
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
            if not isinstance(p.get("sha256"), str) or not _HEX64.match(p["sha256"]):
                raise CheckpointError(f"{pw}: field 'sha256' must be 64 hex digits, not {p.get('sha256')!r:.80}")
            pieces.append(Piece(p["file"], p["key"], start, stop))
            self._digests[(p["file"], p["key"])] = p["sha256"]
        volume = sum(math.prod(b - a for a, b in zip(p.start, p.stop)) for p in pieces)
        if volume != math.prod(shape) or not _tiles(pieces, shape):
            raise CheckpointError(f"{where}: its pieces do not tile the shape {shape} exactly once")
        return TensorEntry(name, shape, t["dtype"], t["layout"], pieces)

    def _open(self, file: str):
        from safetensors import safe_open

        if file not in self._files:
            path = self.path / file
            if path.exists() and not path.is_file():  # a FIFO or a device would block or never end
                raise CheckpointError(f"{path}: not a regular file (the manifest lists pieces in it)")
            try:
                self._files[file] = safe_open(str(path), framework="numpy")
            except FileNotFoundError:
                raise CheckpointError(f"{path}: missing (the manifest lists pieces in it)") from None
            except Exception as e:  # safetensors' own error for truncated or malformed files
                raise CheckpointError(f"{path}: not a readable safetensors file ({str(e).splitlines()[0]})") from None
            stamp, want = _stamp(self._files[file].metadata() or {}), {"run": self.run, "step": self.step, "file": file}
            if stamp != want:
                del self._files[file]
                raise CheckpointError(f"{path}: written as {stamp}, not as this checkpoint's {want}: a file from another "
                                      f"step, run or rank; restore the folder from the run that wrote it")
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
                if _sha256(f.get_tensor(p.key)) != self._digests[(p.file, p.key)]:
                    raise CheckpointError(f"{path}: tensor {p.key!r} does not match the manifest's SHA-256 (the file is "
                                          f"corrupted or from another checkpoint)")
                self._verified.add((p.file, p.key))
            block = sl[tuple(slice(x - s, y - s) for x, y, s in zip(a, b, p.start))]
            out[tuple(slice(x - l, y - l) for x, y, l in zip(a, b, lo))] = block
        return out

    def meta(self, key: str) -> Any:
        return self.manifest[key]

    def count(self) -> int:
        """The number of optimizer updates the checkpoint's state has taken (checked on load)."""
        return self.manifest["count"]


_ST_DTYPES = {"float32": "F32", "int32": "I32", "int64": "I64"}
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_state(m: Mapping[str, Any], path: Path, where: str) -> None:
    """The run's state fields agree with each other and with the folder's name: ``step`` is the
    folder's; ``count`` (AdamW updates) is ``step`` (training) or 0 (parameters only: import-hf);
    one finite loss per update; evaluations at steps 1..step, in order."""
    step, count = m["step"], m["count"]
    named = _DIR.match(path.name)
    if named and int(named.group(1)) != step:
        raise CheckpointError(f"{where}: field 'step' is {step} but the folder is {path.name}")
    if step < 0 or count not in (step, 0):
        raise CheckpointError(f"{where}: field 'count' is {count} at step {step}; a checkpoint has taken one update "
                              f"per step (count = step) or none (count 0)")
    if len(m["losses"]) != count or not all(_finite(x) for x in m["losses"]):
        raise CheckpointError(f"{where}: field 'losses' must hold {count} finite numbers (one per update), not "
                              f"{len(m['losses'])} entries")
    last = 0
    for e in m["evals"]:
        if not (isinstance(e, list) and len(e) == 2 and isinstance(e[0], int) and not isinstance(e[0], bool)
                and last < e[0] <= step and _finite(e[1])):
            raise CheckpointError(f"{where}: field 'evals' must be [step, loss] pairs at increasing steps up to {step}, "
                                  f"not {e!r:.80}")
        last = e[0]
    if not isinstance(m["run"].get("id"), str) or not m["run"]["id"]:
        raise CheckpointError(f"{where}: field 'run' must say the run's id")


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
