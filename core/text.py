"""Byte-level text: the Python standard library's own source (on every machine), or named files.

Tokens are bytes (vocabulary 256). The corpus is the files' bytes in sorted path order, split
into a training part and a held-out tail; batches are random windows drawn from a seeded stream.
``TextData`` is the GPT's ``Dataset``: step t's batch is a function of (seed, t) alone.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

__all__ = ["Corpus", "stdlib_files", "load_corpus", "TextData"]


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)


@dataclass
class Corpus:
    train: np.ndarray  # uint8
    held_out: np.ndarray
    source: str

    def batches(self, batch: int, seq: int, *, seed: int, split: str = "train"):
        """An endless, seeded stream of (tokens, targets), each (batch, seq) int32."""
        data = self.train if split == "train" else self.held_out
        if len(data) <= seq + 1:
            raise ValueError(f"the {split} split of {self.source} has {len(data)} bytes; it needs more than seq+1={seq + 1}.")
        rng = np.random.default_rng(seed)
        while True:
            starts = rng.integers(0, len(data) - seq - 1, batch)
            windows = np.stack([data[s:s + seq + 1] for s in starts]).astype(np.int32)
            yield windows[:, :-1], windows[:, 1:]

    def batch_at(self, step: int, batch: int, seq: int, *, seed: int, split: str = "train"):
        """The (tokens, targets) of training step ``step``: a function of (seed, step) alone, so a
        run resumed at step k reads what the uninterrupted run read there."""
        data = self.train if split == "train" else self.held_out
        if len(data) <= seq + 1:
            raise ValueError(f"the {split} split of {self.source} has {len(data)} bytes; it needs more than seq+1={seq + 1}.")
        starts = np.random.default_rng([seed, step, split == "train"]).integers(0, len(data) - seq - 1, batch)
        windows = np.stack([data[s:s + seq + 1] for s in starts]).astype(np.int32)
        return windows[:, :-1], windows[:, 1:]

    def unigram_entropy(self) -> float:
        """Nats per byte of the held-out bytes' own distribution: what predicting without context gives."""
        counts = np.bincount(self.held_out, minlength=256).astype(np.float64)
        p = counts[counts > 0] / counts.sum()
        return float(-(p * np.log(p)).sum())


def load_corpus(files: Sequence[str | Path] | None = None, *, max_bytes: int = 16 * 2**20,
                held_out: float = 0.05) -> Corpus:
    paths = [Path(f) for f in files] if files else stdlib_files()
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise ValueError(f"corpus file {missing[0]!r} does not exist or is not a file; name readable text files.")
    chunks, total = [], 0
    for p in paths:  # read only the bytes used: a corpus of huge files costs max_bytes, not their size
        with open(p, "rb") as f:
            b = f.read(max_bytes - total)
        chunks.append(b)
        total += len(b)
        if total >= max_bytes:
            break
    data = np.frombuffer(b"".join(chunks), dtype=np.uint8)
    if len(data) < 1024:
        raise ValueError(f"the corpus has {len(data)} bytes; give at least 1 KiB of text.")
    cut = int(len(data) * (1 - held_out))
    return Corpus(data[:cut], data[cut:], "the Python standard library" if not files else f"{len(paths)} file(s)")


class TextData:
    """The GPT's ``Dataset``: windows of ``seq + 1`` bytes of the standard library (or ``files``),
    as ``{"tokens": (B, S), "targets": (B, S)}`` int32, targets shifted by one. The corpus is
    read on first use."""

    def __init__(self, seq: int, files: Sequence[str | Path] = (), *, max_bytes: int = 16 * 2**20):
        self.seq, self.files, self.max_bytes = seq, tuple(str(f) for f in files), max_bytes
        self._corpus: Corpus | None = None

    @property
    def corpus(self) -> Corpus:
        if self._corpus is None:
            self._corpus = load_corpus(list(self.files) or None, max_bytes=self.max_bytes)
        return self._corpus

    @property
    def source(self) -> str:
        return self.corpus.source

    def batch_at(self, step: int, batch: int, *, seed: int, split=None) -> dict[str, np.ndarray]:
        held_out = split is not None and getattr(split, "value", split) == "held_out"
        x, y = self.corpus.batch_at(step, batch, self.seq, seed=seed, split="held_out" if held_out else "train")
        return {"tokens": x, "targets": y}

    def describe(self) -> str:
        c = self.corpus
        return f"{c.source} ({len(c.train):,} train / {len(c.held_out):,} held-out bytes)"

    def baseline(self) -> tuple[str, float]:
        """What predicting without context gives: the held-out bytes' unigram entropy (nats/byte)."""
        return "unigram entropy", self.corpus.unigram_entropy()
