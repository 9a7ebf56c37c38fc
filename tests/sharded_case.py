"""One sharded forward and backward on a torch rank, as the torch and kernel tests check it."""

from parlay import Mesh
from parlay.backends.torch.session import TorchSession
from parlay.core.program import make_program


def run_case(rank, model, params, batch, strategy, axes, *, bucket_bytes=None, coalesce=False, kernels=None):
    """(loss, global grads on rank 0 else None, forward and backward collective counts)."""
    program = make_program(model, strategy, Mesh(dict(axes)), batch=len(next(iter(batch.values()))))
    session = TorchSession(program, params, bucket_bytes=bucket_bytes, coalesce=coalesce, kernels=kernels)
    session.log.clear()
    loss, grads = session.loss_and_grads(batch)
    count = lambda bwd: {(k.value, a): n for (k, a), n in session.log.counts(backward=bwd).items()}
    return loss, grads if rank == 0 else None, count(False), count(True)
