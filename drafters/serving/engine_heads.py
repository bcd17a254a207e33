"""`draftsmith engine-check` for a layout vLLM's CPU build loads but cannot run (DSpark: vllm_dspark.py).

Instead of decoding, vLLM builds the draft model with its own loader (every weight must load; vllm_worker.load_one)
and evaluates the draft's heads on a probe: head states h [n, D] (the backbone's normed output) and the previous
tokens [n]. Ours evaluates the same on the native drafter, so the check says whether vLLM's heads compute ours:
logits = head rows (h + W E[prev]) and confidence = sigmoid(c (h + W E[prev]) + b), float32 both sides.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

LOAD_ONLY = ("dspark",)  # vLLM methods its CPU runner cannot serve
# max |vLLM - ours| over the logits relative to their largest magnitude, and over P(accept), by the export's dtype:
# a 16-bit export stores vLLM's Markov map head rows @ W rounded (unit roundoff 2^-8 in bf16), ours multiplies them
HEADS_TOLERANCE = {"float32": 1e-3, "bfloat16": 1e-2, "float16": 1e-2}


def stored_dtype(export_dir: Path) -> str:
    """The torch_dtype an export's config.json names (float32 when it names none)."""
    return json.loads((export_dir / "config.json").read_text()).get("torch_dtype", "float32")


def probe(module: nn.Module, n: int = 8, seed: int = 0) -> dict:
    """n head states of unit scale and n previous tokens, drawn from `seed`."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, module.target.hidden_size, generator=g)
    prev = torch.randint(0, module.target.vocab_size, (n,), generator=g)
    return {"h": h.tolist(), "prev": prev.tolist()}


@torch.no_grad()
def our_heads(module: nn.Module, p: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Our DSpark's (float32) draft logits [n, N] and P(accept) [n] for probe head states (already normed) and
    tokens."""
    h, prev = torch.tensor(p["h"]), torch.tensor(p["prev"])
    z = h + module.markov(prev)  # head_states without the norm: the probe's h is the normed state
    w, b = module.head_rows()
    logits = z @ w.float().T + (0 if b is None else b.float())
    return logits, module.confidence(z)


def compare_heads(run: dict, module: nn.Module, p: dict, stored: str = "float32") -> dict:
    """The engine's side of a load-only layout's row of engine_check.json (`stored`: the export's torch_dtype)."""
    tol = HEADS_TOLERANCE.get(stored, HEADS_TOLERANCE["bfloat16"])
    row = {"served": False, "identical": None}
    if "error" in run:
        return {**row, "loaded": False, "ok": False, "error": run["error"]}
    logits, conf = our_heads(module, p)
    theirs = torch.tensor(run["logits"])
    gap = float((theirs - logits).abs().max() / logits.abs().max().clamp(min=1e-12))
    conf_gap = None if run["confidence"] is None else float((torch.tensor(run["confidence"]) - conf).abs().max())
    return {
        **row,
        "loaded": True,
        "engine_architecture": run["architecture"],
        "heads_logit_gap": gap,
        "heads_confidence_gap": conf_gap,
        "same_argmax": bool(torch.equal(theirs.argmax(-1), logits.argmax(-1))),
        "heads_tolerance": tol,
        "ok": gap <= tol and conf_gap is not None and conf_gap <= tol,
    }
