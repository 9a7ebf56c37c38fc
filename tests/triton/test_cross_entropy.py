"""Cross entropy kernels (interpreter) against float64 torch, and the vocab-parallel pieces
combined over simulated ranks (the vocabulary cut into 2 or 4 column slices in one process, combined
with the Megatron formulas the torch backend's collectives compute).

Vocab blocks are 64 columns under the interpreter: a vocabulary of 101 is two blocks with a masked
tail, and a slice of 50 or 25 columns is one partial block.

Tolerances, relative to the reference's largest magnitude: fp32 1e-5 (measured: at most 5e-7).
bf16 logits: the loss is returned in bf16 as torch does and the gradient is rounded to bf16 (a
relative step of 2^-8; Triton's interpreter truncates where a GPU rounds to nearest): 1e-2
(measured over seeds: at most 6e-3).
"""

import pytest
import torch
import torch.nn.functional as F

from parlay.triton_kernels import cross_entropy, vocab_parallel_cross_entropy, vocab_parallel_stats

from kernel_checks import leaves, rel_err

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 7, 101), (37, 64), (3, 300)])
def test_mean_cross_entropy_and_its_gradient_equal_float64(shape, dtype):
    x, xd = leaves(3 * torch.randn(shape), dtype=dtype)
    targets = torch.randint(0, shape[-1], shape[:-1])
    loss = cross_entropy(x, targets)
    ref = F.cross_entropy(xd.reshape(-1, shape[-1]), targets.reshape(-1))
    loss.backward()
    ref.backward()
    assert loss.dtype == dtype and loss.shape == ()
    errors = {"loss": rel_err(loss, ref), "grad": rel_err(x.grad, xd.grad)}
    assert max(errors.values()) < TOL[dtype], errors


def megatron_combine(stats):
    """Global (max, sum-exp, target logit) from every rank's local ones: what the torch backend's
    MAX all-reduce and two SUM all-reduces compute."""
    top = torch.stack([m for m, _, _ in stats]).amax(0)
    sumexp = sum(se * torch.exp(m - top) for m, se, _ in stats)
    picked = sum(p for _, _, p in stats)
    return top, sumexp, picked


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ranks", [2, 4])
def test_vocab_parallel_pieces_over_simulated_ranks_equal_the_full_loss(ranks, dtype):
    tokens, vocab = (3, 13), 100
    logits = (3 * torch.randn(*tokens, vocab)).to(dtype)
    targets = torch.randint(0, vocab, tokens)
    width = vocab // ranks
    slices = [logits[..., r * width:(r + 1) * width].detach().requires_grad_() for r in range(ranks)]
    stats = [vocab_parallel_stats(s, targets, r * width) for r, s in enumerate(slices)]
    for r, (m, se, picked) in enumerate(stats):
        local = slices[r].detach().double()
        mine = (targets >= r * width) & (targets < (r + 1) * width)
        want = torch.gather(local, -1, (targets - r * width).clamp(0, width - 1)[..., None])[..., 0] * mine
        assert m.shape == tokens and m.dtype == torch.float32
        assert torch.equal(m.double(), local.amax(-1))
        assert rel_err(se, torch.exp(local - local.amax(-1, keepdim=True)).sum(-1)) < 1e-6
        assert torch.equal(picked.double(), want)  # exactly 0 where the target is another rank's
    combined = megatron_combine(stats)
    g = torch.randn(tokens)  # each rank sees the same per-token loss gradient
    losses = []
    for r, s in enumerate(slices):
        rows = vocab_parallel_cross_entropy(s, targets, vocab_start=r * width, combine=lambda *_: combined)
        rows.backward(g)
        losses.append(rows)
    full = logits.detach().double().requires_grad_()
    ref = F.cross_entropy(full.reshape(-1, vocab), targets.reshape(-1), reduction="none").reshape(tokens)
    ref.backward(g.double())
    for rows in losses:  # every rank has the global per-token losses
        assert rel_err(rows, ref) < 1e-5  # fp32 statistics of exact inputs, in either dtype
    assert rel_err(torch.cat([s.grad for s in slices], -1), full.grad) < TOL[dtype]


def test_bad_inputs_say_what_was_given_and_the_rule():
    x = torch.randn(4, 10)
    with pytest.raises(ValueError, match=r"cross_entropy: targets have shape \(5,\) but logits \(4, 10\); targets "
                                         r"must have the logits' shape without the vocab dim, \(4,\)"):
        cross_entropy(x, torch.zeros(5, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"cross_entropy: targets have dtype torch.float32; they must be int64"):
        cross_entropy(x, torch.zeros(4))
    with pytest.raises(ValueError,
                       match=r"vocab_parallel_stats: logits have shape \(10,\); they must be \(\.\.\., vocab\)"):
        vocab_parallel_stats(x[0], torch.zeros((), dtype=torch.int64))
    with pytest.raises(ValueError, match=r"cross_entropy: logits has dtype torch.int64"):
        cross_entropy(torch.zeros(4, 10, dtype=torch.int64), torch.zeros(4, dtype=torch.int64))
