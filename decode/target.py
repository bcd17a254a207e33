"""The frozen target: load any HF decoder-only LM, run it over prefixes and draft trees by hand.

We run the decoder layers ourselves (embed -> layers -> norm -> lm_head) instead of calling
`model.forward`, because speculative decoding needs three things HF's forward does not give
together: an arbitrary additive tree mask, a layer range [a, b) with its own cache (early exit,
layer skipping, LayerSkip), and hidden states at chosen ids without materialising all of them.

Hidden-state ids follow HF's `output_hidden_states` (DESIGN §3): 0 = embeddings, i = output of
decoder layer i (1..L-1), L = the post-final-norm state.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor, nn

from decode.errors import UserError, one_line, read_json
from decode.kvcache import KVCache
from decode.precision import resolve_dtype
from decode.tree import DraftTree, ancestor_matrix, tree_attention_mask, tree_depths

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def local_config(name_or_path: str | os.PathLike) -> dict | None:
    """A local model directory's config.json as a dict (None: a hub id, or no readable config)."""
    try:
        cfg = json.loads((Path(name_or_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


class LayoutError(ValueError):
    """The model does not have the standard `model.model.{embed_tokens,layers,norm,rotary_emb}` + `lm_head` layout."""


@dataclass
class ForwardOut:
    """What one forward returns: logits at every input position and hidden states at requested ids."""

    logits: Tensor | None  # [T, V]
    hidden: dict[int, Tensor] = field(default_factory=dict)  # id -> [T, D]
    last: Tensor | None = None  # [T, D] the pre-norm output of the last layer run


def resolve_model_path(name_or_path: str | os.PathLike) -> str:
    """A local directory, or a hub id that must already be in the local cache when offline."""
    p = Path(name_or_path)
    if p.exists():
        if not (p / "config.json").exists():
            raise FileNotFoundError(f"{p} exists but has no config.json: point --target at a model directory")
        read_json(p / "config.json", "the model's config.json is damaged: copy or download the model again")
        return str(p)
    s = str(name_or_path)
    if s.startswith((".", "/", "~")) or s.count("/") != 1:
        raise FileNotFoundError(f"model directory not found: {s}")
    return s


def load_model(name_or_path: str | os.PathLike, dtype: str = "float32", attn: str = "sdpa",
               device: str = "cpu", device_map: dict[str, str] | None = None,
               offload_folder: str | None = None) -> nn.Module:
    """Load an HF causal LM (trust_remote_code off) with a clear error when it cannot be found.

    With `device_map` (see decode.offload) accelerate places each module and attaches the hooks
    that stream offloaded layers; `device` is then ignored (the map says where everything goes).
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a 47-tensor "Loading weights" bar per load is noise
    dtype = resolve_dtype(dtype, device if device_map is None else "cpu", local_config(name_or_path))
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} not one of {sorted(DTYPES)} or 'auto'")
    path = resolve_model_path(name_or_path)
    placed = {} if device_map is None else dict(device_map=device_map, offload_folder=offload_folder)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], attn_implementation=attn,
                                                     trust_remote_code=False, **placed)
    except SafetensorError as e:  # a truncated or corrupt weight file (an interrupted download or copy)
        raise UserError(f"{broken_file(path)}: not a readable safetensors file ({one_line(e)}); copy or download "
                        "the model again") from None
    except OSError as e:
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        hint = " (HF_HUB_OFFLINE=1: download it first or pass a local directory)" if offline else ""
        raise FileNotFoundError(f"cannot load model {str(name_or_path)!r}{hint}: {e}") from e
    if device_map is None:
        model = model.to(device)
    return model.eval().requires_grad_(False)


def broken_file(model_dir: str) -> str:
    """The first safetensors file of a local model directory whose header does not read (else the directory)."""
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        try:
            with safe_open(str(f), "pt"):
                pass
        except SafetensorError:
            return str(f)
    return model_dir


def load_tokenizer(name_or_path: str | os.PathLike):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(name_or_path), trust_remote_code=False)


class Target:
    """A frozen decoder-only LM run layer by layer. State lives only in the KVCache objects it is given."""

    def __init__(self, model: nn.Module, tokenizer=None) -> None:
        inner = getattr(model, "model", None)
        missing = [n for n in ("embed_tokens", "layers", "norm", "rotary_emb") if not hasattr(inner, n)]
        if inner is None or missing or not hasattr(model, "lm_head"):
            what = "model.model" if inner is None else ", ".join(f"model.model.{n}" for n in missing) or "lm_head"
            raise LayoutError(f"{type(model).__name__} lacks the standard decoder-only layout ({what}); "
                              "draftsmith needs model.model.{embed_tokens,layers,norm,rotary_emb} and lm_head")
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
        self.placement = None  # a decode.offload.Placement when loaded with streamed (offloaded) layers

    @classmethod
    def load(cls, name_or_path: str | os.PathLike, dtype: str = "float32", attn: str = "sdpa",
             device: str = "cpu", device_map: dict[str, str] | None = None,
             offload_folder: str | None = None) -> Target:
        """`device_map`/`offload_folder`: accelerate placement (decode.offload.load_target builds them);
        dtype `auto` = resolve_dtype."""
        model = load_model(name_or_path, dtype=dtype, attn=attn, device=device, device_map=device_map,
                           offload_folder=offload_folder)
        try:
            tok = load_tokenizer(name_or_path)
        except (OSError, ValueError):
            tok = None
        t = cls(model, tok)
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
            raise ValueError(f"hidden-state ids {bad} out of range 0..{self.num_layers} (0 = embeddings, "
                             f"{self.num_layers} = final normed state)")

    # --- pieces ---------------------------------------------------------------------------

    def embed(self, ids: Tensor) -> Tensor:
        return self.embed_tokens(ids.view(1, -1).to(self.device))  # [1, T, D]

    def head(self, h: Tensor) -> Tensor:
        """Final norm + LM head on pre-norm states. [.., D] -> [.., V]"""
        return self.lm_head(self.norm(h))

    def run_layers(self, h: Tensor, start: int, end: int, cache: KVCache | None, positions: Tensor,
                   mask: Tensor | None = None, capture: tuple[int, ...] = (),
                   skip: frozenset[int] = frozenset(),
                   layers: nn.ModuleList | None = None) -> tuple[Tensor, dict[int, Tensor]]:
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
        layers = self.layers if layers is None else layers
        for i in range(start, end):
            if i not in skip:
                h = layers[i](h, attention_mask=mask, position_ids=pos, cache=cache, use_cache=cache is not None,
                              position_embeddings=rope)
            if i + 1 in capture:
                captured[i + 1] = (self.norm(h) if i + 1 == self.num_layers else h)[0]
        return h, captured

    # --- whole passes ---------------------------------------------------------------------

    def forward(self, ids: Tensor, cache: KVCache | None, positions: Tensor | None = None,
                mask: Tensor | None = None, hidden_ids: tuple[int, ...] = (), logits: bool = True) -> ForwardOut:
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

    def forward_batch(self, ids: Tensor, attention_mask: Tensor, hidden_ids: tuple[int, ...] = (),
                      position_ids: Tensor | None = None) -> tuple[Tensor, dict[int, Tensor]]:
        """No-cache pass over a padded or packed batch: ids [B, T], attention_mask [B, T].

        attention_mask: 0 = padding, k > 0 = the k-th sequence packed into the row (plain padding: 1);
        a token attends to earlier tokens with the same nonzero value (left or right padding both work).
        position_ids [B, T] default to the index within each sequence. Returns the pre-norm output of
        the last layer [B, T, D] and {id: [B, T, D]} at `hidden_ids`; padded positions hold garbage.
        """
        self.check_hidden_ids(hidden_ids)
        ids, seg = ids.to(self.device), attention_mask.to(self.device)
        b, t = ids.shape
        ar = torch.arange(t, device=self.device).expand(b, t)
        if position_ids is None:  # restart counting where the segment value changes
            new = torch.ones_like(seg, dtype=torch.bool)
            new[:, 1:] = seg[:, 1:] != seg[:, :-1]
            position_ids = ar - torch.cummax(torch.where(new, ar, 0), dim=1).values
        pos = position_ids.to(self.device)
        allowed = (ar[:, None, :] <= ar[:, :, None]) & (seg[:, None, :] == seg[:, :, None]) & (seg[:, None, :] > 0)
        allowed |= torch.eye(t, dtype=torch.bool, device=self.device)  # no fully masked row (padding)
        mask = torch.zeros(b, 1, t, t, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~allowed[:, None], torch.finfo(self.dtype).min)  # additive float [B, 1, T, T]
        h = self.embed_tokens(ids)  # [B, T, D]
        rope = self.rotary_emb(h, pos)
        captured = {0: h} if 0 in hidden_ids else {}
        for i, layer in enumerate(self.layers):
            h = layer(h, attention_mask=mask, position_ids=pos, cache=None, use_cache=False, position_embeddings=rope)
            if i + 1 in hidden_ids:
                captured[i + 1] = self.norm(h) if i + 1 == self.num_layers else h
        return h, captured

    def prefill(self, prompt_ids: Tensor, cache: KVCache, hidden_ids: tuple[int, ...] = ()) -> ForwardOut:
        return self.forward(prompt_ids, cache, hidden_ids=hidden_ids)

    def forward_tree(self, root: int, tree: DraftTree, cache: KVCache, hidden_ids: tuple[int, ...] = (),
                     reuse: LayerReuse | None = None, side: SideRows | None = None,
                     logits: bool = True) -> ForwardOut:
        """One pass over [root] + tree nodes; returns logits [1 + N, V] (row 0 = root).

        logits=False skips the LM head (logits None; `last` holds the pre-norm rows for `head`), for a
        verifier that applies it only to the rows it visits (decode.verify.LazyRows).

        Positions are prefix length + depth, the mask lets a node see the prefix and its ancestors.
        With `reuse`, the first `reuse.layers` layers were already run (by an early-exit drafter,
        writing those layers' scratch KV) for the first rows: only the rest go through them.
        With `side`, E more rows ride along in the same pass (logits [1 + N + E, V]): no tree row
        sees them, so the tree's logits are unchanged, and their KV lands past the tree's, where
        compacting to the accepted path drops it.
        """
        prefix = cache.lens[-1]
        parents = torch.cat([torch.tensor([-1]), tree.parents.cpu() + 1]) if tree.size else torch.tensor([-1])
        ids = torch.cat([torch.tensor([root]), tree.tokens.cpu()])
        positions = prefix + tree_depths(parents).to(self.device)
        mask = tree_attention_mask(parents, prefix, self.dtype, self.device) if tree.size else None
        if side is not None and side.tokens.numel():
            if reuse is not None:
                raise ValueError("side rows and early-layer reuse cannot be combined in one tree pass")
            ids = torch.cat([ids, side.tokens.cpu()])
            positions = torch.cat([positions, prefix + side.offsets.to(self.device)])
            mask = side_mask(parents, side, prefix, self.dtype, self.device)
        k = reuse.layers if reuse is not None else 0
        n = reuse.hidden.shape[0] if reuse is not None else 0
        if any(ln != prefix + (n if i < k else 0) for i, ln in enumerate(cache.lens)):
            raise RuntimeError(f"target cache lengths {cache.lens} do not match prefix {prefix} (+{n} reused "
                               f"in layers < {k}): a drafter left scratch entries in the target cache")
        self.check_hidden_ids(hidden_ids)
        if reuse is None:
            h, hid = self.run_layers(self.embed(ids), 0, self.num_layers, cache, positions, mask, tuple(hidden_ids))
            return ForwardOut(self.head(h)[0] if logits else None, hid, h[0])
        # LayerSkip-style reuse: rows [0, n) already have layer-K states and K-layer KV in the cache.
        if any(i <= k for i in hidden_ids if i > 0) or 0 in hidden_ids:
            raise ValueError("hidden ids at or below the reused layers are not available with reuse")
        rest = ids[n:]
        h_k = reuse.hidden.unsqueeze(0)
        if rest.numel():
            sub = mask[:, :, n:] if mask is not None else None
            h_rest, _ = self.run_layers(self.embed(rest), 0, k, cache, positions[n:], sub, ())
            h_k = torch.cat([h_k, h_rest], dim=1)
        h, hid = self.run_layers(h_k, k, self.num_layers, cache, positions, mask, tuple(hidden_ids))
        return ForwardOut(self.head(h)[0] if logits else None, hid, h[0])


@dataclass
class SideRows:
    """Rows verified alongside a tree but never committed (lookahead decoding's Jacobi window).

    Each sees the whole cached prefix, the root if see[i, 0], side row j if see[i, 1 + j], and no
    tree node; it sits at position (root's position + offsets[i]).
    """

    tokens: Tensor  # [E] long
    offsets: Tensor  # [E] long
    see: Tensor  # [E, 1 + E] bool


def side_mask(parents: Tensor, side: SideRows, prefix: int, dtype: torch.dtype,
              device: torch.device | str) -> Tensor:
    """Additive float mask [1, 1, R, prefix + R] for R = 1 + N + E rows: [root] + tree, then side rows."""
    n, e = parents.numel(), side.tokens.numel()
    allowed = torch.zeros(n + e, n + e, dtype=torch.bool)
    allowed[:n, :n] = ancestor_matrix(parents)  # the tree (root included) never sees side rows
    see = side.see.cpu().bool()
    allowed[n:, 0] = see[:, 0]
    allowed[n:, n:] = see[:, 1:]
    m = torch.zeros(n + e, prefix + n + e, dtype=dtype)
    m[:, prefix:].masked_fill_(~allowed, torch.finfo(dtype).min)
    return m.to(device).view(1, 1, n + e, prefix + n + e)


@dataclass
class LayerReuse:
    """Layers [0, layers) already run for the first rows of a tree pass (their KV sits in the target cache)."""

    layers: int
    hidden: Tensor  # [n, D] pre-norm output of layer `layers` for rows 0..n-1 of [root] + nodes


def causal_mask(past: int, t: int, dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """Additive float causal mask [1, 1, t, past + t] for t new tokens after `past` cached ones."""
    m = torch.full((t, past + t), torch.finfo(dtype).min, dtype=dtype, device=device)
    m[:, :past] = 0
    m[:, past:] = torch.triu(m[:, past:], diagonal=1)
    return m.view(1, 1, t, past + t)


def check_same_tokenizer(target: Target, draft: Target, what: str) -> None:
    """Refuse a drafter whose vocabulary (token -> id) or special tokens differ from the target's."""
    tt, dt = target.tokenizer, draft.tokenizer
    if tt is None or dt is None:
        if target.vocab_size != draft.vocab_size:
            raise ValueError(f"{what}: vocab size {draft.vocab_size} differs from the target's {target.vocab_size}")
        return
    if tt.get_vocab() != dt.get_vocab():
        a, b = tt.get_vocab(), dt.get_vocab()
        diff = sorted(set(a.items()) ^ set(b.items()))[:3]
        raise ValueError(f"{what}: its tokenizer differs from the target's ({len(a)} vs {len(b)} tokens; "
                         f"e.g. {diff}); a draft model must share the target's tokenizer")
    for attr in ("bos_token_id", "eos_token_id"):
        if getattr(tt, attr) != getattr(dt, attr):
            raise ValueError(f"{what}: {attr} {getattr(dt, attr)} differs from the target's {getattr(tt, attr)}")
    if draft.vocab_size < len(tt.get_vocab()):
        raise ValueError(f"{what}: LM head covers {draft.vocab_size} tokens, the tokenizer has {len(tt.get_vocab())}")
