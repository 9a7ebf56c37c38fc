"""parlay layouts convert to DTensor and back exactly, or refuse with a clear error."""

from parlay.backends.torch.launch import spawn

import workers


def test_round_trips_and_refusals():
    results = spawn(workers.dtensor_round_trips, 4, timeout_s=120)
    for rank_out in results:
        *cases, strided, uneven = rank_out
        for name, full_ok, layout_ok, local_ok, redistributed_ok in cases:
            assert full_ok and layout_ok and local_ok and redistributed_ok, name
        assert "splits dim 0 over ('tp', 'dp'), not in the mesh's axis order ('dp', 'tp'); DTensor would need" in strided
        assert "the DTensor's shards are uneven" in uneven and "not divisible by 2" in uneven
