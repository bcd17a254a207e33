"""The frozen target: load any HF decoder-only LM, run it over prefixes and draft trees by hand.

We run the decoder layers ourselves (embed -> layers -> norm -> lm_head) instead of calling
`model.forward`, because speculative decoding needs three things HF's forward does not give
together: an arbitrary additive tree mask, a layer range [a, b) with its own cache (early exit,
layer skipping, LayerSkip), and hidden states at chosen ids without materialising all of them.

Hidden-state ids follow HF's `output_hidden_states` (DESIGN §3): 0 = embeddings, i = output of
decoder layer i (1..L-1), L = the post-final-norm state.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from decode.kvcache import KVCache
from decode.loading import check_layout, load_model, load_tokenizer
from decode.masks import causal_mask
from decode.runtime import Runtime


@dataclass
class ForwardOut:
    """What one forward returns: logits at every input position and hidden states at requested ids."""

    logits: Tensor | None  # [T, V]
    hidden: dict[int, Tensor] = field(default_factory=dict)  # id -> [T, D]
    last: Tensor | None = None  # [T, D] the pre-norm output of the last layer run


RUNTIMES = ("fast", "hf")


class Target:
    """A frozen decoder-only LM run layer by layer. State lives only in the KVCache objects it is given."""

    def __init__(self, model: nn.Module, tokenizer=None, runtime: str = "fast") -> None:
        check_layout(model)
        if runtime not in RUNTIMES:
            raise ValueError(f"runtime {runtime!r} not one of {RUNTIMES}")
        inner = model.model
        self.model, self.tokenizer = model, tokenizer
        self.config = model.config
        self.embed_tokens, self.layers = inner.embed_tokens, inner.layers
        self.norm, self.rotary_emb, self.lm_head = inner.norm, inner.rotary_emb, model.lm_head
        self.num_layers = len(self.layers)
        self.hidden_size = self.config.hidden_size
        self.vocab_size = self.lm_head.weight.shape[0]
        self.max_positions = int(getattr(self.config, "max_position_embeddings", 1 << 30))
        eos = getattr(model.generation_config, "eos_token_id", None) or self.config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.placement = None  # a decode.placement.Placement when loaded with streamed (offloaded) layers
        # the packed runtime (decode.runtime) for gradient-free passes; None: HF's modules run every layer
        self.runtime = Runtime(self.layers, self.norm, self.lm_head, self.config) if runtime == "fast" else None

    @classmethod
    def load(cls, name_or_path: str | os.PathLike, runtime: str = "fast", **options: Any) -> Target:
        """A model directory or hub id with its tokenizer (None when it has none). `runtime`: fast | hf (see
        decode.runtime). `options` are load_model's: dtype (`auto` = resolve_dtype), attn, device, and accelerate
        placement (device_map, offload_folder, which decode.offload.load_target builds)."""
        try:
            tok = load_tokenizer(name_or_path)
        except (OSError, ValueError):
            tok = None
        t = cls(load_model(name_or_path, **options), tok, runtime)
        t.name_or_path = str(name_or_path)
        return t

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def new_cache(self) -> KVCache:
        return KVCache(self.num_layers)

    def check_hidden_ids(self, ids) -> None:
        bad = [i for i in ids if not 0 <= i <= self.num_layers]
        if bad:
            raise ValueError(
                f"hidden-state ids {bad} out of range 0..{self.num_layers} (0 = embeddings, "
                f"{self.num_layers} = final normed state)"
            )

    # --- pieces ---------------------------------------------------------------------------

    def embed(self, ids: Tensor) -> Tensor:
        return self.embed_tokens(ids.view(1, -1).to(self.device))  # [1, T, D]

    def fast(self) -> Runtime | None:
        """The packed runtime when it may run this pass: asked for, supported, no autograd, nothing offloaded."""
        if self.runtime is None or self.placement is not None or torch.is_grad_enabled():
            return None
        return self.runtime if self.runtime.ready() else None

    def head(self, h: Tensor) -> Tensor:
        """Final norm + LM head on pre-norm states. [.., D] -> [.., V]"""
        fast = self.fast()
        return fast.logits(h) if fast is not None else self.lm_head(self.norm(h))

    def run_layers(
        self,
        h: Tensor,
        start: int,
        end: int,
        cache: KVCache | None,
        positions: Tensor,
        mask: Tensor | None = None,
        capture: tuple[int, ...] = (),
        skip: frozenset[int] = frozenset(),
        layers: nn.ModuleList | None = None,
    ) -> tuple[Tensor, dict[int, Tensor]]:
        """Run decoder layers [start, end) (minus `skip`) on h [1, T, D] at `positions` [T].

        mask: additive float [1, 1, T, S] over the cache's tokens plus these (None = full attention,
        valid for T == 1 or an empty cache with mask built by the caller). Returns the pre-norm
        output [1, T, D] and the captured hidden states {id: [T, D]} for ids in (start, end].
        `layers`: run these in place of the target's own, indexed like them (a drafter's trained copies of
        the first layers); the target's rotary embedding and norm stay.
        """
        pos = positions.view(1, -1).to(h.device)
        rope = self.rotary_emb(h, pos)
        captured: dict[int, Tensor] = {}
        if start in capture and start == 0:
            captured[0] = h[0]
        fast = self.fast() if layers is None else None
        layers = self.layers if layers is None else layers
        kwargs = dict(attention_mask=mask, position_ids=pos, cache=cache, use_cache=cache is not None)
        kwargs["position_embeddings"] = rope
        for i in range(start, end):
            if i not in skip:
                h = fast.step(i, h, cache, rope, mask) if fast is not None else layers[i](h, **kwargs)
            if i + 1 in capture:
                captured[i + 1] = (self.norm(h) if i + 1 == self.num_layers else h)[0]
        return h, captured

    # --- whole passes ---------------------------------------------------------------------

    def forward(
        self,
        ids: Tensor,
        cache: KVCache | None,
        positions: Tensor | None = None,
        mask: Tensor | None = None,
        hidden_ids: tuple[int, ...] = (),
        logits: bool = True,
    ) -> ForwardOut:
        """All layers over ids [T] appended to `cache`; causal over the new tokens unless `mask` is given."""
        past = cache.lens[0] if cache is not None else 0
        t = ids.numel()
        if positions is None:
            positions = torch.arange(past, past + t, device=self.device)
        if mask is None and t > 1:
            mask = causal_mask(past, t, self.dtype, self.device)
        self.check_hidden_ids(hidden_ids)
        h, hid = self.run_layers(self.embed(ids), 0, self.num_layers, cache, positions, mask, tuple(hidden_ids))
        return ForwardOut(self.head(h)[0] if logits else None, hid, h[0])

    def prefill(self, prompt_ids: Tensor, cache: KVCache, hidden_ids: tuple[int, ...] = ()) -> ForwardOut:
        return self.forward(prompt_ids, cache, hidden_ids=hidden_ids)
