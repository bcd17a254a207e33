"""KVCache.compact: the in-place fast path (AR rounds, accepted chain prefixes) equals the general move."""

from __future__ import annotations

import pytest
import torch

from decode.kvcache import KVCache


def filled(n: int) -> KVCache:
    cache = KVCache(2)
    for layer in range(2):
        k = torch.arange(n, dtype=torch.float32).view(1, 1, n, 1).expand(1, 2, n, 3) + 100 * layer
        cache.update(k, -k, layer)
    return cache


def kept(cache: KVCache, layer: int = 0) -> list[float]:
    return cache.keys[layer][0, 0, : cache.lens[layer], 0].tolist()


@pytest.mark.parametrize("keep", [[0], [0, 1, 2], [0, 2, 3], [0, 3]])
def test_compact_keeps_the_right_positions(keep):
    cache = filled(10)
    cache.compact(5, torch.tensor(keep))
    assert cache.lens == [5 + len(keep)] * 2
    assert kept(cache) == [0, 1, 2, 3, 4] + [5 + i for i in keep]
    assert kept(cache, 1) == [100 + x for x in kept(cache)]
    assert cache.values[1][0, 0, : cache.lens[1], 0].tolist() == [-x for x in kept(cache, 1)]


def test_compact_refuses_positions_past_the_cache():
    for keep in ([0, 1, 2, 3, 4, 5], [0, 6]):
        with pytest.raises(IndexError, match="cannot keep position"):
            filled(10).compact(5, torch.tensor(keep))
