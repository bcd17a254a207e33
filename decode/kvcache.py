"""The target's KV cache: preallocated buffers with one length per layer, compacted in place after verification."""

from __future__ import annotations

from torch import Tensor


class KVCache:
    """Preallocated K/V buffers, one length per layer; HF attention modules call `update`.

    Per-layer lengths let a drafter that runs only layers [0, K) (early exit) append draft tokens
    to those layers while the deeper layers stay at the committed length. Buffers grow by doubling.
    """

    def __init__(self, num_layers: int) -> None:
        self.keys: list[Tensor | None] = [None] * num_layers
        self.values: list[Tensor | None] = [None] * num_layers
        self.lens: list[int] = [0] * num_layers

    def update(
        self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[Tensor, Tensor]:
        # key_states: [B, kv_heads, T, head_dim]
        n, t = self.lens[layer_idx], key_states.shape[2]
        self._reserve(layer_idx, key_states, n + t)
        k, v = self.keys[layer_idx], self.values[layer_idx]
        k[:, :, n : n + t] = key_states
        v[:, :, n : n + t] = value_states
        self.lens[layer_idx] = n + t
        return k[:, :, : n + t], v[:, :, : n + t]

    def _reserve(self, i: int, like: Tensor, need: int) -> None:
        buf = self.keys[i]
        if buf is not None and buf.shape[2] >= need:
            return
        cap = max(need, 64 if buf is None else 2 * buf.shape[2])
        shape = (like.shape[0], like.shape[1], cap, like.shape[3])
        new_k, new_v = like.new_empty(shape), like.new_empty(shape)
        if buf is not None:
            n = self.lens[i]
            new_k[:, :, :n] = buf[:, :, :n]
            new_v[:, :, :n] = self.values[i][:, :, :n]
        self.keys[i], self.values[i] = new_k, new_v

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.lens[layer_idx]

    def crop(self, length: int, layers: range | None = None) -> None:
        """Forget everything past `length` tokens (in the given layers, default all)."""
        for i in layers if layers is not None else range(len(self.lens)):
            self.lens[i] = min(self.lens[i], length)

    def compact(self, start: int, keep: Tensor) -> None:
        """Keep positions `start + keep` (in order) right after the first `start` tokens, drop the rest.

        Used after verification: the accepted root-to-node path of a tree is moved into place.
        """
        idx = keep.tolist()
        m = len(idx)
        # AR rounds and accepted chain prefixes keep 0..m-1: already in place, a crop is enough
        in_place = idx == list(range(m))
        for i, n in enumerate(self.lens):
            if n <= start:
                continue
            if start + max(idx, default=-1) >= n:
                raise IndexError(f"layer {i}: cannot keep position {start + max(idx)} of {n} cached tokens")
            if not in_place:
                src = keep.to(self.keys[i].device) + start
                for buf in (self.keys[i], self.values[i]):
                    buf[:, :, start : start + m] = buf[:, :, src]
            self.lens[i] = start + m
