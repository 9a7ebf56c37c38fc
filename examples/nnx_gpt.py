"""parlay's GPT as a Flax NNX module, trained sharded in an ordinary NNX loop (nnx.jit,
nnx.value_and_grad, nnx.Optimizer with optax), then continued on torch through a parlay checkpoint.

    python examples/nnx_gpt.py --dir out/nnx-gpt           # 4 of 8 steps under fsdp+tp on 8 JAX devices
    parlay train --model tiny --steps 8 --batch 8 --warmup 3 --lr 1e-2 --backend torch \\
        --mesh dp=2,tp=2 --strategy dp+tp --checkpoint-dir out/nnx-gpt --resume

The module's parameters are parlay's (names, logical dims, initial bits), placed in the layouts
fsdp+tp gives them; ``adamw`` is parlay's optimizer as one optax transformation, so the loop takes
the steps ``parlay train`` takes, and the checkpoint resumes on any backend, strategy and mesh.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before JAX starts

from flax import nnx  # noqa: E402

from parlay.flax_nnx import GPT, adamw, save_checkpoint  # noqa: E402
from parlay.core.optim import OptimizerConfig  # noqa: E402
from parlay.training import TrainSpec, dataset_of  # noqa: E402


@nnx.jit
def step(model, opt, batch):
    """One update: the loss and its gradients (nnx.value_and_grad), then the optimizer's step."""
    loss, grads = nnx.value_and_grad(lambda m: m.loss(batch))(model)
    opt.update(model, grads)
    return loss


def train(model, opt, spec: TrainSpec, steps, *, save_at: int | None = None) -> list[float]:
    """Updates ``steps`` (indices t) on the batches parlay train reads (``batch_at(t, spec.batch,
    seed=spec.seed)``), saving a parlay checkpoint after update ``save_at``; the losses."""
    data = dataset_of(model.model, spec.data)
    losses = []
    for t in steps:
        losses.append(float(step(model, opt, model.placement.batch(data.batch_at(t, spec.batch, seed=spec.seed)))))
        if save_at == t + 1:
            save_checkpoint(spec, model, opt, losses)
    return losses


def main(argv=None) -> list[float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="the checkpoint folder (new)")
    ap.add_argument("--steps", type=int, default=4, help="NNX steps to take of the 8-step run")
    args = ap.parse_args(argv)
    # What the torch resume will check: model, data (default text, seed 0, batch 8) and optimizer
    # (parlay train's --lr 1e-2 --warmup 3, cosine to --steps 8).
    optimizer = OptimizerConfig(lr=1e-2, warmup=3, decay_steps=8)
    spec = TrainSpec(backend="torch", strategy="dp+tp", mesh=(("dp", 2), ("tp", 2)), model="tiny", steps=8, batch=8,
                     optimizer=optimizer, checkpoint_dir=args.dir)
    model = GPT("tiny", strategy="fsdp+tp", mesh={"dp": 2, "tp": 4}, batch=8)
    opt = nnx.Optimizer(model, adamw(optimizer), wrt=nnx.Param)
    losses = train(model, opt, spec, range(args.steps), save_at=args.steps)
    for t, loss in enumerate(losses):
        print(f"step {t + 1}  loss {loss:.6f}")
    print(f"saved {args.dir}/step-{args.steps:08d}; continue it on torch with\n  parlay train --model tiny --steps 8 "
          f"--batch 8 --warmup 3 --lr 1e-2 --backend torch --mesh dp=2,tp=2 --strategy dp+tp --checkpoint-dir "
          f"{args.dir} --resume")
    return losses


if __name__ == "__main__":
    main()
