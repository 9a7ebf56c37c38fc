"""One sharded forward and backward on a torch rank, as the torch and kernel tests check it."""

from parlay import Mesh
from parlay.backends.torch.train import ShardedModel


def run_case(rank, model, params, x, y, strategy, axes, *, bucket_bytes=None, coalesce=False):
    """(loss, global grads on rank 0 else None, forward and backward collective counts)."""
    sm = ShardedModel(model, strategy, Mesh(dict(axes)), batch=len(x), bucket_bytes=bucket_bytes, coalesce=coalesce)
    local = sm.shard(params)
    loss = sm.loss(local, x, y)
    sm.backward(loss)
    grads = sm.gather_grads(local)
    count = lambda bwd: {(k.value, a): n for (k, a), n in sm.log.counts(backward=bwd).items()}
    return float(loss.detach()), grads if rank == 0 else None, count(False), count(True)
