"""Hugging Face generation as evaluation peers, run by `decode.evaluate` beside our own decoder.

SPECs: `hf-generate` (plain HF `generate()`, the AR peer), `hf-assisted:early-exit:K` (HF assisted
generation with `assistant_early_exit=K`: the target's first K layers draft), `hf-assisted:draft-model:DIR`
(HF assisted generation with an assistant model), `hf-prompt-lookup[:ngram=3,k=10]` (HF
`prompt_lookup_num_tokens=k`, `max_matching_ngram_size=ngram`).

τ is counted with forward hooks: the target's *last* decoder layer runs once per target pass and
never while drafting (an early-exit assistant stops at layer K, an assistant model has its own
layers), so new tokens / its calls is τ on the same footing as ours (prefill counted as a pass).
Assistants draft a fixed chain of --draft-len tokens (`num_assistant_tokens_schedule="constant"`,
confidence-threshold stopping off) so that they propose what our `chain` shape proposes; HF reads
these settings from the assistant's own generation config, not from `generate()` arguments.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor, nn

from decode.generate import Generation
from decode.loading import check_same_tokenizer
from decode.metrics import GenStats
from decode.options import parse_kv
from decode.sampling import SamplingConfig
from decode.target import Target

HF_FORMS = ["hf-generate", "hf-assisted:early-exit:K", "hf-assisted:draft-model:DIR", "hf-prompt-lookup[:ngram=3,k=10]"]


def is_hf_spec(spec: str) -> bool:
    return spec.startswith("hf-")


class CallCounter:
    """`with CallCounter(module) as c:` counts the module's forward calls inside the block (a forward hook)."""

    def __init__(self, module: nn.Module) -> None:
        self.module, self.calls = module, 0

    def _hook(self, module: nn.Module, args, output) -> None:
        self.calls += 1

    def __enter__(self) -> CallCounter:
        self._handle = self.module.register_forward_hook(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()


def fixed_chain_assistant(model: nn.Module, k: int) -> None:
    """Make `model`, as an assistant, draft exactly k tokens a round (HF reads this from its generation config)."""
    cfg = model.generation_config
    cfg.num_assistant_tokens = k
    cfg.num_assistant_tokens_schedule = "constant"
    cfg.assistant_confidence_threshold = 0.0


class HFPeer:
    """One HF generation mode; `run` decodes one prompt and returns tokens with counted statistics."""

    kind = "hf"

    def __init__(self, name: str, target: Target, gen_kwargs: dict, draft_layer: nn.Module | None = None) -> None:
        self.name, self.target, self.gen_kwargs = name, target, gen_kwargs
        # early exit drafts through the target's own first layer; an assistant model through its own
        self.draft_layer = draft_layer if draft_layer is not None else target.layers[0]
        self.draft_is_target = draft_layer is None

    def run(self, prompt_ids: Tensor, max_new_tokens: int, sampling: SamplingConfig, seed: int) -> Generation:
        ids = prompt_ids.view(1, -1).to(self.target.device)  # [1, T]
        eos = sorted(self.target.eos_ids)
        if sampling.greedy:
            mode = dict(do_sample=False)
        else:
            mode = dict(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
        torch.manual_seed(seed)  # HF samples from the global generator
        start = time.perf_counter()
        with (
            torch.inference_mode(),
            CallCounter(self.target.layers[-1]) as last,
            CallCounter(self.draft_layer) as first,
        ):
            # max_length, not max_new_tokens, which HF warns conflicts with the model's own max_length
            out = self.target.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_length=ids.shape[1] + max_new_tokens,
                eos_token_id=eos or None,
                pad_token_id=eos[0] if eos else None,
                **mode,
                **self.gen_kwargs,
            )
        wall = time.perf_counter() - start
        tokens = out[0, ids.shape[1] :].tolist()
        passes, firsts = last.calls, first.calls
        stats = GenStats(
            new_tokens=len(tokens),
            target_passes=passes,
            rounds=max(0, passes - 1),
            wall_s=wall,
            drafter_passes=firsts - passes if self.draft_is_target else firsts,
        )
        return Generation(tokens, stats)


def make_hf_peer(spec: str, target: Target, draft_len: int) -> HFPeer:
    """The HF peer a SPEC names (see HF_FORMS); assisted peers draft chains of `draft_len` tokens."""
    name, _, arg = spec.partition(":")
    if name == "hf-generate" and not arg:
        return HFPeer(spec, target, {})
    if name == "hf-prompt-lookup":
        kv = parse_kv(arg, {"ngram": 3, "k": 10}, f"drafter {spec!r}")
        return HFPeer(
            spec, target, {"prompt_lookup_num_tokens": int(kv["k"]), "max_matching_ngram_size": int(kv["ngram"])}
        )
    if name == "hf-assisted":
        how, _, val = arg.partition(":")
        if how == "early-exit":
            k = int(val) if val.isdigit() else -1
            if not 1 <= k < target.num_layers:
                raise ValueError(
                    f"{spec}: K must be an integer in 1..{target.num_layers - 1} for a {target.num_layers}-layer target"
                )
            fixed_chain_assistant(target.model, draft_len)
            return HFPeer(spec, target, {"assistant_early_exit": k})
        if how == "draft-model" and val:
            draft = Target.load(val, dtype=str(target.dtype).removeprefix("torch."), device=str(target.device))
            check_same_tokenizer(target, draft, spec)
            fixed_chain_assistant(draft.model, draft_len)
            return HFPeer(spec, target, {"assistant_model": draft.model}, draft_layer=draft.layers[0])
    forms = "\n  ".join(HF_FORMS)
    raise ValueError(f"unknown HF peer SPEC {spec!r}; valid forms:\n  {forms}")
