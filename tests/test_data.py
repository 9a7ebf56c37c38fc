import numpy as np
import pytest

from parlay.core.text import load_corpus, stdlib_files


def test_stdlib_corpus_batches_and_entropy():
    assert len(stdlib_files()) > 100
    corpus = load_corpus(max_bytes=2**20)
    assert len(corpus.train) + len(corpus.held_out) == 2**20
    x, y = next(corpus.batches(4, 32, seed=0))
    assert x.shape == y.shape == (4, 32) and x.dtype == np.int32
    assert (x[:, 1:] == y[:, :-1]).all()  # targets are the next bytes
    again = next(corpus.batches(4, 32, seed=0))[0]
    assert (again == x).all()  # seeded
    # Text and code carry about 4-5 bits per byte (2.8-3.5 nats); uniform bytes would be ln 256.
    assert 2.0 < corpus.unigram_entropy() < np.log(256)


def test_named_files(tmp_path):
    f = tmp_path / "a.txt"
    f.write_bytes(b"hello parlay " * 200)
    corpus = load_corpus([f])
    assert corpus.source == "1 file(s)" and len(corpus.held_out) > 0
    with pytest.raises(ValueError, match=r"corpus file '.*missing.txt' does not exist or is not a file"):
        load_corpus([tmp_path / "missing.txt"])
    (tmp_path / "b.txt").write_bytes(b"x" * 10)
    with pytest.raises(ValueError, match=r"the corpus has 10 bytes; give at least 1 KiB"):
        load_corpus([tmp_path / "b.txt"])
