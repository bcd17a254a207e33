"""The points of a learning curve and what they say: scripts/learning_curve.py's pure parts besides the plots.

A point is one dict per (run, step): {"run", "step", "trained_tokens", "shapes": {shape: {"tau", "by_depth",
"new_tokens", "per_prompt"}}, "config", "lever"?, ...}, one JSON line of OUT/points.jsonl. This module
reads earlier points files (`--reference`), names what a run changes against the base run (its lever),
computes the paired τ difference to the base over the same prompts, and writes the markdown table.
Nothing here loads a model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from train.config import Recipe, to_dict

# Settings that say where and how often a run reports, not what it trains: not a lever.
BOOKKEEPING = (
    "run_dir",
    "name",
    "train.save_every",
    "train.keep_checkpoints",
    "train.log_every",
    "train.report_to",
    "train.eval_every",
    "train.eval_batches",
    "train.threads",
    "train.sim_",
)
# The field's small-budget reference (speculators' EAGLE-3 examples: 5k samples x 5 epochs on 8B targets,
# 3 draft tokens): tau 1.45-1.49, acceptance by position ~0.35 / 0.10 / 0.02 (issue 19's survey).
FIELD = {
    "label": "speculators EAGLE-3, 5k samples x 5 epochs, k=3",
    "tau": (1.45, 1.49),
    "by_depth": (0.35, 0.10, 0.02),
}


def read_references(paths: list[str]) -> list[dict]:
    """The points of earlier points.jsonl files, each marked `reference` (they are shown, never re-evaluated)."""
    out = []
    for path in map(Path, paths):
        if not path.is_file():
            raise SystemExit(f"error: --reference {path}: no such file (a points.jsonl this script wrote)")
        out += [{**json.loads(line), "reference": str(path)} for line in path.read_text().splitlines() if line.strip()]
    return out


# --- levers: what a run changes against the base run ----------------------------------------------------


def flatten(config: dict, prefix: str = "") -> dict[str, object]:
    """A nested config as {dotted.key: value} (the form of the CLI's overrides)."""
    out: dict[str, object] = {}
    for k, v in config.items():
        out.update(flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def lever(config: dict, base: dict) -> str:
    """What a run changes against the base run, as `key=value` overrides (bookkeeping keys left out);
    "(base)" for none. Another drafter kind is one change, `drafter.kind=K (its drafter.K section)`: the two
    kinds' sections have different keys, so comparing them key by key would only list both. A key only one side
    has counts unless it holds the schema's default there (a config written before the key existed ran at it)."""
    defaults = flatten(to_dict(Recipe(target="")))
    a, b = flatten(config), flatten(base)
    a, b = (
        {**{k: v for k, v in defaults.items() if k in b}, **a},
        {**{k: v for k, v in defaults.items() if k in a}, **b},
    )
    kind, base_kind = a.get("drafter.kind"), b.get("drafter.kind")
    sections = (f"drafter.{kind}.", f"drafter.{base_kind}.") if kind != base_kind else ()
    diff = [
        f"{k}={a.get(k)}" + (f" (its drafter.{kind} section)" if k == "drafter.kind" else "")
        for k in sorted(a.keys() | b.keys())
        if a.get(k) != b.get(k) and not k.startswith(BOOKKEEPING + sections)
    ]
    return ", ".join(diff) or "(base)"


# --- statistics of a point ---------------------------------------------------------------------------------


def ratio(by_depth: list[float]) -> float | None:
    """depth-2 / depth-1 acceptance: how much of the depth-1 acceptance survives one more draft step."""
    return by_depth[1] / by_depth[0] if len(by_depth) > 1 and by_depth[0] > 0 else None


def paired_delta(run: list[float], base: list[float]) -> tuple[float, float]:
    """Mean per-prompt τ difference run - base over the same prompts, and its standard error: the same prompts
    decoded by two drafters differ less than two independent samples would, so this is the spread to read."""
    d = torch.tensor(run, dtype=torch.float64) - torch.tensor(base, dtype=torch.float64)
    se = d.std().item() / len(d) ** 0.5 if len(d) > 1 else float("nan")
    return d.mean().item(), se


def chain_depths(p: dict) -> list[float]:
    """Acceptance by depth of the point's longest chain (chain-8; a block drafter of 8 drafts chain-7 at most)."""
    chains = sorted((int(k.removeprefix("chain-")), v) for k, v in p["shapes"].items() if k.startswith("chain-"))
    return chains[-1][1].get("by_depth", []) if chains else []


def delta_text(p: dict, points: list[dict], shapes: list[str]) -> str:
    """The 'Δ τ vs base' cell of a lever table: per shape, the paired difference to the base run's point at the
    same step (else its last), where both carry per-prompt τ over the same number of prompts."""
    base = sorted((q for q in points if q.get("lever") == "(base)"), key=lambda q: (q["step"] != p["step"], -q["step"]))
    if p.get("lever") == "(base)" or not base:
        return "-"
    cells = []
    for s in shapes:
        a, b = p["shapes"].get(s, {}).get("per_prompt"), base[0]["shapes"].get(s, {}).get("per_prompt")
        if a and b and len(a) == len(b):
            m, se = paired_delta(a, b)
            cells.append(f"{s} {m:+.3f} ± {se:.3f}")
    other = f" (vs its step {base[0]['step']})" if cells and base[0]["step"] != p["step"] else ""
    return "; ".join(cells) + other if cells else "-"


# --- the table ---------------------------------------------------------------------------------------------


def write_table(points: list[dict], shapes: list[str], path: Path) -> str:
    """The markdown table of every point, run by run in step order (with levers: what each run changes and its
    paired τ difference to the base run)."""
    levers = any("lever" in p for p in points)
    head = (
        "| run | "
        + ("changes (vs the base run) | " if levers else "")
        + "step | trained tokens | "
        + " | ".join(f"τ {s}" for s in shapes)
        + " | longest chain's acceptance by depth 1–3 | depth-2 / depth-1 |"
        + (" Δ τ vs base (paired, ± SE over prompts) |" if levers else "")
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for p in sorted(points, key=lambda p: (p["run"], p["step"])):
        c8 = chain_depths(p)
        r = ratio(c8)
        tok = f"{p['trained_tokens']:,}" if p.get("trained_tokens") else "-"
        changes = f"{p.get('lever', '-')} | " if levers else ""
        name = p["run"] + (f" (from {Path(p['reference']).name})" if p.get("reference") else "")
        lines.append(
            f"| {name} | {changes}{p['step']} | {tok} | "
            + " | ".join(f"{p['shapes'][s]['tau']:.3f}" if s in p["shapes"] else "-" for s in shapes)
            + f" | {', '.join(f'{a:.3f}' for a in c8[:3])} | {'-' if r is None else f'{r:.2f}'} |"
            + (f" {delta_text(p, points, shapes)} |" if levers else "")
        )
    lo, hi = FIELD["tau"]
    taus = [f"τ {lo}–{hi} (k=3)"] + [""] * (len(shapes) - 1)  # under the first τ column, whatever the shapes
    lines.append(
        f"| *{FIELD['label']}* | {'| ' if levers else ''}| | " + " | ".join(taus) + " | "
        f"{', '.join(str(a) for a in FIELD['by_depth'])} | {FIELD['by_depth'][1] / FIELD['by_depth'][0]:.2f} |"
        + (" |" if levers else "")
    )
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


# --- levers over seeds -------------------------------------------------------------------------------------


def without_seed(lever_text: str) -> str:
    """A lever label with its `seed=N` change dropped: the runs of one lever at several seeds share it."""
    parts = [x for x in lever_text.split(", ") if not x.startswith("seed=") and x != "(base)"]
    return ", ".join(parts) or "(base)"


def last_points(points: list[dict]) -> dict[str, dict]:
    """{run: its last labelled point} (the drafter a lever run ends with), runs in first-seen order."""
    last: dict[str, dict] = {}
    for p in points:
        if "lever" in p and p["step"] >= last.get(p["run"], {"step": -1})["step"]:
            last[p["run"]] = p
    return last


def seed_groups(points: list[dict], shapes: list[str]) -> dict[str, dict[str, list[float]]]:
    """{lever without its seed: {shape: τ of each run's last point}}, levers in first-seen order."""
    groups: dict[str, dict[str, list[float]]] = {}
    for p in last_points(points).values():
        g = groups.setdefault(without_seed(p["lever"]), {s: [] for s in shapes})
        for s in shapes:
            if s in p["shapes"]:
                g[s].append(p["shapes"][s]["tau"])
    return groups


def seed_of(p: dict) -> int:
    """The seed a point's run trained with (0 when its stored config does not say)."""
    return int((p.get("config") or {}).get("seed", 0))


def seed_pairs(points: list[dict], shapes: list[str]) -> dict[str, dict[str, list[tuple[int, float, float]]]]:
    """{lever without its seed: {shape: [(seed, paired Δ τ, SE)]}}: each run's last point against the base run of
    the same seed over the same prompts; a seed changes the data too, so this removes that spread."""
    last = last_points(points)
    bases = {seed_of(p): p for p in last.values() if without_seed(p["lever"]) == "(base)"}
    out: dict[str, dict[str, list[tuple[int, float, float]]]] = {}
    for p in last.values():
        name, base = without_seed(p["lever"]), bases.get(seed_of(p))
        if name == "(base)" or base is None:
            continue
        g = out.setdefault(name, {s: [] for s in shapes})
        for s in shapes:
            run, ref = p["shapes"].get(s, {}).get("per_prompt"), base["shapes"].get(s, {}).get("per_prompt")
            if run and ref and len(run) == len(ref):
                g[s].append((seed_of(p), *paired_delta(run, ref)))
    return out


def seed_verdict(delta: float, lever_taus: list[float], base_taus: list[float]) -> str:
    """A lever's Δ τ against the seed spread: the larger seed-to-seed range of the lever's and the base's runs."""
    if min(len(lever_taus), len(base_taus)) < 2:
        return "one seed: no spread"
    spread = max(max(lever_taus) - min(lever_taus), max(base_taus) - min(base_taus))
    if abs(delta) <= spread:
        return f"inside the seed spread ({spread:.3f})"
    return f"{'gain' if delta > 0 else 'loss'} beyond the seed spread ({spread:.3f})"


def seed_table(points: list[dict], shapes: list[str]) -> str:
    """Markdown: each lever's mean τ over its seeds (min–max), Δ against the base's mean and whether that is
    inside the seed spread; "" when no lever has two seeds (the per-prompt table is then the spread to read)."""
    groups = seed_groups(points, shapes)
    if "(base)" not in groups or all(len(t) < 2 for g in groups.values() for t in g.values()):
        return ""
    base = groups["(base)"]
    head = "| lever (seeds pooled) | seeds | " + " | ".join(f"τ {s} (min–max) | Δ {s} vs base" for s in shapes) + " |"
    head += " Δ paired with its seed's base, ± SE (" + ", ".join(shapes) + ") |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    pairs = seed_pairs(points, shapes)
    for name, g in groups.items():
        cells = []
        for s in shapes:
            taus, ref = g[s], base[s]
            if not taus or not ref:
                cells.append("- | -")
                continue
            mean, delta = sum(taus) / len(taus), sum(taus) / len(taus) - sum(ref) / len(ref)
            rel = "-" if name == "(base)" else f"{delta:+.3f}, {seed_verdict(delta, taus, ref)}"
            cells.append(f"{mean:.3f} ({min(taus):.3f}–{max(taus):.3f}) | {rel}")
        per_seed = "; ".join(
            f"{s}: " + ", ".join(f"s{seed} {d:+.3f} ± {se:.3f}" for seed, d, se in pairs[name][s])
            for s in shapes
            if pairs.get(name, {}).get(s)
        )
        lines.append(f"| {name} | {max(len(t) for t in g.values())} | " + " | ".join(cells) + f" | {per_seed or '-'} |")
    return "\n".join(lines) + "\n"
