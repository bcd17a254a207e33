"""A report row's short label — drafter kind + draft shape (`eagle3 · tree 24`, `prompt-lookup`, `AR`) — for the
plots and report.md's first column (the full SPEC stays beside it), and a drafter entry's τ per conversation.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

OWN_TREES = ("prompt-lookup", "lookahead")  # drafters that propose their own trees: no shape to show


def shape_label(shape: str | None) -> str:
    """`chain k=8` -> `chain 8`, `dynamic:topk=8,depth=6,nodes=24` -> `tree 24`, `dynamic:topk=4,depth=1,nodes=4` ->
    `top-4`, `static nodes=9` -> `static 9`."""
    if not shape:
        return ""
    if shape.startswith("no drafting"):  # --tree auto predicted no shape faster than plain decoding
        return "no draft"
    if shape.startswith("chain k="):
        return f"chain {shape.removeprefix('chain k=')}"
    if shape.startswith("dynamic:"):
        opts = dict(kv.partition("=")[::2] for kv in shape.removeprefix("dynamic:").split(","))
        if opts.get("depth") == "1":  # the root's top-k alone: one drafter call
            return f"top-{opts.get('topk', '?')}"
        return f"tree {opts.get('nodes', '?')}"
    if shape.startswith("static nodes="):
        return f"static {shape.removeprefix('static nodes=')}"
    return shape


def drafter_kind(spec: str, kind: str | None = None) -> str:
    """A row's draft source in a few characters: `early-exit:4`, `prompt-lookup`, `draft-model`, `AR`, or
    `kind` (a checkpoint's drafter kind, e.g. eagle3) for a directory, else the directory's own name."""
    base = spec.rpartition("@")[0] if "@" in spec else spec
    name = base.partition(":")[0]
    if base == "ar":
        return "AR"
    if name in OWN_TREES or name == "draft-model":
        return name
    if name in ("early-exit", "skip") or base.startswith("hf-"):
        return base
    return kind or Path(base).name


def row_label(spec: str, shape: str | None, kind: str | None = None, auto: bool = False) -> str:
    """The short label a plot shows for a row: `eagle3 · tree 24`, `prompt-lookup`, `early-exit:4 · chain 8`,
    `medusa · auto: tree 16` (the full SPEC goes in report.md)."""
    who = drafter_kind(spec, kind)
    if who == "AR" or who.startswith("hf-"):
        return who
    own = who in OWN_TREES
    what = "" if own else shape_label(shape)
    if auto:
        return f"{who} · auto" + (f": {what}" if what else "")
    return f"{who} · {what}" if what else who


def label_of(d: dict) -> str:
    """row_label of a report.json drafter entry."""
    return row_label(d["spec"], d.get("shape"), d.get("drafter_kind"), bool(d.get("auto")))


def drafter_name(path: str) -> str:
    """The name a trained drafter's directory goes by: its own, or its run's for a run's `export/`
    (`runs/2026-12-04/e3-2500-5k/export` -> `e3-2500-5k`)."""
    p = Path(path)
    return p.parent.name if p.name == "export" and p.parent.name else p.name


def distinct_labels(ds: list[dict]) -> dict[str, str]:
    """spec -> label_of, with the drafter's directory name added to every row of a drafter whose kind another
    drafter directory in the report shares (two trained EAGLE-3 drafters: `eagle3 · chain 8 (e3-2500)`, and their
    `auto` rows too, whose shapes may differ), and to any two rows that would still read the same."""
    labels = {d["spec"]: label_of(d) for d in ds}
    base = {d["spec"]: d["spec"].partition("@")[0].rstrip("/") for d in ds}
    named = {s for s in labels if base[s] not in labels[s]}  # rows whose label does not already say their source
    dirs: dict[str, set[str]] = {}  # drafter kind -> the directories its rows come from
    for d in ds:
        if d.get("drafter_kind") and d["spec"] in named:
            dirs.setdefault(d["drafter_kind"], set()).add(base[d["spec"]])
    counts = Counter(labels.values())
    for d in ds:
        shared = d["spec"] in named and len(dirs.get(d.get("drafter_kind"), ())) > 1
        if shared or counts[labels[d["spec"]]] > 1:
            labels[d["spec"]] += f" ({drafter_name(base[d['spec']])})"
    return labels


def per_conversation_tau(d: dict) -> list[float]:
    """τ of each conversation (all its turns) of a drafter entry, in first-seen order."""
    tok: dict[str, list[int]] = {}
    for row in d["prompts"]:
        t = tok.setdefault(row["id"], [0, 0])
        t[0] += row["new_tokens"]
        t[1] += row["target_forward_passes"]
    return [n / p for n, p in tok.values() if p]


def checkpoint_kind(spec: str) -> str | None:
    """The drafter kind of a checkpoint directory SPEC, from its config.json (None: not a directory)."""
    base = spec.rpartition("@")[0] if "@" in spec else spec
    try:
        cfg = json.loads((Path(base) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    arch = " ".join(cfg.get("architectures") or [])
    return (
        cfg.get("draftsmith_drafter")
        or cfg.get("speculators_model_type")
        or ("eagle3" if "Eagle3" in arch else "medusa" if "num_heads" in cfg else None)
    )
