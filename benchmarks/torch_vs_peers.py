"""parlay's torch backend against PyTorch's own tools, on 4 gloo CPU ranks, in one run.

For each pair, the same GPT (same weights, same batch, same math) takes training steps
(forward, backward, gradient clipping at norm 1, AdamW) and the median milliseconds per step are compared:

- data parallel: parlay ``dp`` (bucketed gradient sync) vs ``DistributedDataParallel``;
- FSDP: parlay ``fsdp`` vs FSDP2 ``fully_shard`` (per block, then the root);
- Megatron TP: parlay ``tp`` vs DTensor ``parallelize_module`` with Colwise/RowwiseParallel on
  the attention and MLP projections (the embedding and LM head stay replicated there; parlay's
  ``tp`` also splits the vocabulary).

The peers' model is a plain ``nn.Module`` using the same ops as parlay's torch reference; the
first step's loss is printed for both, so the comparison is checked to be like for like.

    python benchmarks/torch_vs_peers.py             # default: embed 256, 4 layers, seq 64, batch 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from parlay import Mesh
from parlay.backends.torch.launch import spawn
from parlay.backends.torch.ops import TorchLocal
from parlay.backends.torch.session import TorchSession
from parlay.core.models.gpt import GPT, GPTConfig, Norm, rotary_tables
from parlay.core.ops import DenseOps
from parlay.core.program import make_program

OPS = DenseOps(TorchLocal())


class PlainBlock(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        E, H, K, D = c.embed, c.heads, c.kv_heads, c.head_dim
        self.c = c
        self.norm1, self.norm2 = nn.Parameter(torch.ones(E)), nn.Parameter(torch.ones(E))
        self.wq, self.wk, self.wv = nn.Linear(E, H * D, bias=False), nn.Linear(E, K * D, bias=False), nn.Linear(E, K * D, bias=False)
        self.wo = nn.Linear(H * D, E, bias=False)
        self.w_in, self.w_gate = nn.Linear(E, c.mlp, bias=False), nn.Linear(E, c.mlp, bias=False)
        self.w_out = nn.Linear(c.mlp, E, bias=False)

    def forward(self, x, cos, sin):
        B, S, _ = x.shape
        D = self.c.head_dim
        h = OPS.rms_norm(x, self.norm1, self.c.eps)
        q = OPS.rotary(self.wq(h).view(B, S, -1, D), cos, sin)  # -1: local heads under TP
        k = OPS.rotary(self.wk(h).view(B, S, -1, D), cos, sin)
        v = self.wv(h).view(B, S, -1, D)
        x = x + self.wo(OPS.attention(q, k, v).reshape(B, S, -1))
        h = OPS.rms_norm(x, self.norm2, self.c.eps)
        return x + self.w_out(OPS.silu(self.w_gate(h)) * self.w_in(h))


class PlainGPT(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.c = c
        self.embed = nn.Embedding(c.vocab, c.embed)
        self.blocks = nn.ModuleList(PlainBlock(c) for _ in range(c.layers))
        self.final_norm = nn.Parameter(torch.ones(c.embed))
        self.head = nn.Linear(c.embed, c.vocab, bias=False)
        cos, sin = rotary_tables(c.seq, c.head_dim, c.rope_base)
        self.register_buffer("cos", torch.from_numpy(cos), persistent=False)
        self.register_buffer("sin", torch.from_numpy(sin), persistent=False)

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x, self.cos, self.sin)
        return OPS.cross_entropy(self.head(OPS.rms_norm(x, self.final_norm, self.c.eps)), targets)

    @torch.no_grad()
    def load_neutral(self, params):
        """Copy parlay's neutral parameters (same init, so both sides start equal)."""
        t = lambda k: torch.from_numpy(params[k])
        self.embed.weight.copy_(t("embed.table"))
        for i, b in enumerate(self.blocks):
            p = f"blocks.{i}."
            b.norm1.copy_(t(p + "norm1.scale")); b.norm2.copy_(t(p + "norm2.scale"))
            for name in ("wq", "wk", "wv"):
                getattr(b, name).weight.copy_(t(p + f"attn.{name}").reshape(self.c.embed, -1).T)
            b.wo.weight.copy_(t(p + "attn.wo").reshape(-1, self.c.embed).T)
            b.w_in.weight.copy_(t(p + "mlp.w_in").T); b.w_gate.weight.copy_(t(p + "mlp.w_gate").T)
            b.w_out.weight.copy_(t(p + "mlp.w_out").T)
        self.final_norm.copy_(t("final_norm.scale"))
        self.head.weight.copy_(t("lm_head.w").T)


def _clip_mixed(params, max_norm: float) -> None:
    """Global-norm clipping for a TP model mixing DTensor (sharded) and plain (replicated) grads,
    which ``clip_grad_norm_`` refuses: sharded squares are summed across ranks, replicated once."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        sharded = torch.zeros(())
        replicated = torch.zeros(())
        for p in params:
            g = p.grad
            if isinstance(g, DTensor):
                sharded += g.to_local().pow(2).sum()
            else:
                replicated += g.pow(2).sum()
        dist.all_reduce(sharded)
        norm = torch.sqrt(sharded + replicated)
        if norm > max_norm:
            for p in params:
                p.grad.mul_(max_norm / norm)


def _time(step, steps: int) -> tuple[float, float]:
    first = step()
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times), first


def _peer(kind: str, config: GPTConfig, params, x, y, steps: int):
    from torch.distributed.device_mesh import init_device_mesh

    model = PlainGPT(config)
    model.load_neutral(params)
    world = dist.get_world_size()
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model)
        per = len(x) // world
        sl = slice(dist.get_rank() * per, (dist.get_rank() + 1) * per)
        xb, yb = torch.as_tensor(x[sl]), torch.as_tensor(y[sl])
    elif kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world,))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
        per = len(x) // world
        sl = slice(dist.get_rank() * per, (dist.get_rank() + 1) * per)
        xb, yb = torch.as_tensor(x[sl]), torch.as_tensor(y[sl])
    else:  # dtensor TP
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        mesh = init_device_mesh("cpu", (world,))
        plan = {}
        for i in range(config.layers):
            for n in ("wq", "wk", "wv", "w_in", "w_gate"):
                plan[f"blocks.{i}.{n}"] = ColwiseParallel()
            for n in ("wo", "w_out"):
                plan[f"blocks.{i}.{n}"] = RowwiseParallel()
        parallelize_module(model, mesh, plan)
        xb, yb = torch.as_tensor(x), torch.as_tensor(y)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = model(xb, yb)
        loss.backward()
        if kind == "dtensor":
            _clip_mixed(list(model.parameters()), 1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # parlay clips too
        opt.step()
        loss = loss.detach()
        if kind != "dtensor":  # each DP rank has its own batch slice: average the losses
            dist.all_reduce(loss)
            loss /= world
        return float(loss)

    return _time(step, steps)


def _parlay(strategy: str, config: GPTConfig, params, x, y, steps: int):
    world = dist.get_world_size()
    axis = "tp" if strategy == "tp" else "dp"
    session = TorchSession(make_program(GPT(config), strategy, Mesh({axis: world}), batch=len(x)), params)
    batch = {"tokens": x, "targets": y}
    return _time(lambda: session.step(batch), steps)


def worker(rank: int, config: GPTConfig, batch: int, steps: int):
    torch.manual_seed(0)
    model = GPT(config)
    params = model.init(0)
    tokens = np.random.default_rng(0).integers(0, config.vocab, (batch, config.seq + 1)).astype(np.int32)
    x, y = tokens[:, :-1], tokens[:, 1:]
    rows = []
    for ours, peer, label in (("dp", "ddp", "DistributedDataParallel"), ("fsdp", "fsdp2", "FSDP2 fully_shard"),
                              ("tp", "dtensor", "DTensor parallelize_module")):
        t_ours, l_ours = _parlay(ours, config, params, x, y, steps)
        t_peer, l_peer = _peer(peer, config, params, x, y, steps)
        rows.append((ours, label, t_ours, t_peer, l_ours, l_peer))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--embed", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args(argv)
    config = GPTConfig(vocab=args.vocab, seq=args.seq, embed=args.embed, heads=8, kv_heads=8, layers=args.layers,
                       mlp=4 * args.embed, norm=Norm.RMS)
    rows = spawn(worker, args.ranks, config, args.batch, args.steps, timeout_s=1800)[0]
    print(f"{args.ranks} gloo ranks on the CPU, embed {args.embed}, {args.layers} layers, seq {args.seq}, "
          f"batch {args.batch}, vocab {args.vocab}; median of {args.steps} training steps (clipping, AdamW)\n")
    print("| parlay | peer | parlay ms/step | peer ms/step | parlay / peer | first loss parlay | first loss peer |")
    print("|---|---|---|---|---|---|---|")
    for ours, label, t_ours, t_peer, l_ours, l_peer in rows:
        print(f"| {ours} | {label} | {t_ours:.1f} | {t_peer:.1f} | {t_ours / t_peer:.2f} | {l_ours:.6f} | {l_peer:.6f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
