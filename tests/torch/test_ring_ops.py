"""Ring attention's op on gloo ranks (P2P shifts): output, log-sum-exp, dq, dk, dv equal full
attention in float64 (tests/ring_cases.py, bound 2e-5 of the largest element), and the bytes each
rank's shifts sent forward and backward equal ``ring_traffic``. One spawn per world size."""

import ring_cases as rc
from parlay import Mesh
from parlay.backends.torch.launch import spawn
from parlay.core.ring import ring_traffic

import workers


def test_ring_op_equals_full_attention_on_torch():
    by_size: dict = {}
    for case in rc.CASES:
        by_size.setdefault(Mesh(case[0]).size, []).append(case)
    for size, cases in by_size.items():
        ranks = spawn(workers.ring_ops, size, cases, timeout_s=300)
        for case in cases:
            per_rank = [r[rc.key(case)] for r in ranks]
            rc.check(case, [rc.assemble(case, [p[0][i] for p in per_rank]) for i in range(5)])
            ring, (_, k, _, _) = rc.ring_of(case), rc.arrays(case)
            want = ring_traffic(ring.n, batch=k.shape[0], seq=k.shape[1], kv_heads=k.shape[2], head_dim=k.shape[3],
                                itemsize=4)
            assert {(p[1], p[2]) for p in per_rank} == {(want["forward"], want["backward"])}, rc.key(case)
