"""The evaluation report: report.json (DESIGN §6) and report.md, plus the cost model.

Everything here is a pure function of the per-turn results `decode.evaluate` collects, except
`write_report`, which writes report.json, report.md and the PNG plots (decode.harness.plots) all or
nothing, so an interrupted run never leaves a half-written report.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from decode.harness.labels import distinct_labels
from decode.harness.plots import PLOTS, plot
from decode.metrics import GenStats

COST_FORMULA = (
    "time_per_token = (T + d) / tau, speedup_vs_ar = (T + d_ar) / time_per_token, where T is the "
    "given target-pass cost in seconds, tau the measured mean accepted tokens per target pass, "
    "d = (draft_s + commit_s) / target_forward_passes the measured drafting and bookkeeping seconds "
    "per target pass on this machine, and d_ar the same for the AR run; assumes one target pass costs T "
    "whatever the draft size (memory-bound target)"
)


@dataclass
class TurnResult:
    """One generation: which conversation turn, its prompt length, the emitted tokens and statistics."""

    id: str
    category: str
    turn: int
    prompt_tokens: int
    tokens: list[int]
    stats: GenStats


@dataclass
class SpecRun:
    """All turns one SPEC decoded; kind is "draftsmith" (our decoder) or "hf" (an HF peer)."""

    name: str
    spec: str
    kind: str
    turns: list[TurnResult]


# --- the numbers ------------------------------------------------------------------------


def total_stats(turns: list[TurnResult]) -> GenStats:
    out = GenStats()
    for t in turns:
        out = out.merge(t.stats)
    return out


def overhead_per_pass(stats: GenStats) -> float:
    """d: seconds per target pass spent outside the target's verification pass (draft + commit)."""
    return (stats.draft_s + stats.commit_s) / stats.target_passes if stats.target_passes else 0.0


def cost_model(tau: float, d: float, d_ar: float, pass_costs: list[float]) -> list[dict]:
    """Projected time per token and speedup vs AR at each target-pass cost T (see COST_FORMULA)."""
    rows = []
    for T in pass_costs:
        per_token = (T + d) / tau if tau > 0 else float("inf")
        rows.append(
            {
                "target_pass_s": T,
                "draft_s_per_pass": d,
                "time_per_token_s": per_token,
                "speedup_vs_ar": (T + d_ar) / per_token,
            }
        )
    return rows


def histogram(values: list[int]) -> list[int]:
    """counts[i] = how many values equal i."""
    counts = [0] * (max(values, default=-1) + 1)
    for v in values:
        counts[v] += 1
    return counts


def group_row(turns: list[TurnResult], matches: list[bool] | None) -> dict:
    """Summed counts over some turns (a category, a whole run); the ratios follow from the sums."""
    s = total_stats(turns)
    return {
        "prompts": len(turns),
        "new_tokens": s.new_tokens,
        "target_forward_passes": s.target_passes,
        "drafter_forward_passes": s.drafter_passes,
        "wall_time_s": s.wall_s,
        "mean_accepted_tokens": s.tau,
        "tokens_per_s": s.tokens_per_s,
        "matches_ar": None if matches is None else all(matches),
    }


def drafter_entry(run: SpecRun, ar: SpecRun, greedy: bool, pass_costs: list[float]) -> dict:
    """One drafter's block of report.json."""
    s, s_ar = total_stats(run.turns), total_stats(ar.turns)
    matches = [t.tokens == a.tokens for t, a in zip(run.turns, ar.turns)] if greedy else None
    ours = run.kind == "draftsmith"
    entry = {"name": run.name, "spec": run.spec, "kind": run.kind, **s.summary()}
    entry["speedup_vs_ar"] = s.tokens_per_s / s_ar.tokens_per_s if s_ar.tokens_per_s else 0.0
    entry["matches_ar"] = None if matches is None else all(matches)
    if ours:
        entry["accepted_length_histogram"] = histogram(s.accepted_lengths)
        entry["cost_model"] = cost_model(s.tau, overhead_per_pass(s), overhead_per_pass(s_ar), pass_costs)
    else:  # HF peers: passes are counted with hooks, the per-round detail is not observable
        for key in ("acceptance_by_depth", "mean_draft_nodes", "time_split_s"):
            entry[key] = None
        entry["accepted_length_histogram"] = None
        entry["cost_model"] = None
    categories: dict[str, list[int]] = {}
    for i, t in enumerate(run.turns):
        categories.setdefault(t.category, []).append(i)
    entry["per_category"] = {
        c: group_row([run.turns[i] for i in idx], None if matches is None else [matches[i] for i in idx])
        for c, idx in categories.items()
    }
    entry["prompts"] = [
        {
            "id": t.id,
            "category": t.category,
            "turn": t.turn,
            "prompt_tokens": t.prompt_tokens,
            **group_row([t], None if matches is None else [matches[i]]),
        }
        for i, t in enumerate(run.turns)
    ]
    for row in entry["prompts"]:
        del row["prompts"]
    return entry


def build_report(runs: list[SpecRun], settings: dict, pass_costs: list[float]) -> dict:
    """report.json: settings, the cost-model formula, and one entry per run (runs[0] is the AR reference)."""
    ar = runs[0]
    greedy = settings.get("temperature", 0.0) == 0.0
    return {
        "settings": settings,
        "cost_model": {"formula": COST_FORMULA, "target_pass_s": pass_costs},
        "drafters": [drafter_entry(r, ar, greedy, pass_costs) for r in runs],
    }


# --- writing ----------------------------------------------------------------------------


def fmt(x: float | None, spec: str = ".2f") -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    return format(x, spec)


def markdown(report: dict) -> str:
    """report.md: the main table, the cost model, per-category τ, acceptance by depth, the plots."""
    st, ds = report["settings"], report["drafters"]
    costs = report["cost_model"]["target_pass_s"]
    label = distinct_labels(ds)  # two drafters of one kind: every table names which is which, as the plots do
    lines = [
        "# draftsmith evaluation",
        "",
        f"target `{st.get('target')}` · prompts `{st.get('prompts')}` ({st.get('turns')} turns) · "
        f"max_new_tokens {st.get('max_new_tokens')} · temperature {st.get('temperature')} · "
        f"tree `{st.get('tree')}` · draft_len {st.get('draft_len')} · policy `{st.get('policy')}`",
        "",
        "| row | SPEC | τ | tokens/s | speedup vs AR | matches AR | target passes | drafter passes | "
        "draft / verify / commit s | " + " | ".join(f"proj. speedup @ {c:g} s" for c in costs) + " |",
        "|---" * (9 + len(costs)) + "|",
    ]
    for d in ds:
        split = d["time_split_s"]
        split_s = " / ".join(f"{split[k]:.2f}" for k in ("draft", "verify", "commit")) if split else "–"
        proj = [fmt(r["speedup_vs_ar"]) for r in d["cost_model"]] if d["cost_model"] else ["–"] * len(costs)
        lines.append(
            f"| {label[d['spec']]} | `{d['name']}` | {d['mean_accepted_tokens']:.3f} | {d['tokens_per_s']:.1f} | "
            f"{d['speedup_vs_ar']:.2f} | {fmt(d['matches_ar'])} | {d['target_forward_passes']} | "
            f"{d['drafter_forward_passes']} | {split_s} | " + " | ".join(proj) + " |"
        )
    lines += ["", f"Cost model: {report['cost_model']['formula']}.", ""]
    cats = list(dict.fromkeys(c for d in ds for c in d["per_category"]))
    lines += ["## τ per category", "", "| drafter | " + " | ".join(cats) + " |", "|---" * (len(cats) + 1) + "|"]
    for d in ds:
        row = [
            fmt(d["per_category"][c]["mean_accepted_tokens"], ".3f") if c in d["per_category"] else "–" for c in cats
        ]
        lines.append(f"| {label[d['spec']]} | " + " | ".join(row) + " |")
    depth = max((len(d["acceptance_by_depth"] or []) for d in ds), default=0)
    if depth:
        lines += [
            "",
            "## Acceptance by depth (P(accepted ≥ d | drafted to depth d))",
            "",
            "| drafter | " + " | ".join(f"d{i + 1}" for i in range(depth)) + " |",
            "|---" * (depth + 1) + "|",
        ]
        for d in ds:
            acc = d["acceptance_by_depth"] or []
            if acc:
                lines.append(
                    f"| {label[d['spec']]} | " + " | ".join(fmt(a) for a in acc) + " |" * (1 + depth - len(acc))
                )
    autos = [d for d in ds if d.get("auto")]
    if autos:
        lines += [
            "",
            "## --tree auto: predicted vs measured",
            "",
            "Predicted from the calibrated acceptance by (depth, rank) and the pass-cost curve measured in this "
            "run (decode.harness.autoshape); τ predicted per round, measured over the run (prefill pass included).",
            "",
            "| row | shape chosen | τ predicted | τ measured | speedup predicted | speedup measured | calibration |",
            "|---|---|---|---|---|---|---|",
        ]
        for d in autos:
            a = d["auto"]
            src = ("cached " if a["calibration_cached"] else "") + (
                f"`{a['calibration']}`" if a["calibration"] else "–"
            )
            lines.append(
                f"| {label[d['spec']]} | `{a['shape']}` | {fmt(a['predicted_tau'])} | {fmt(a['measured_tau'])} | "
                f"{fmt(a['predicted_speedup_vs_ar'])} | {fmt(a['measured_speedup_vs_ar'])} | {src} |"
            )
    lines += ["", *[f"![{p[:-4]}]({p})" for p in PLOTS], ""]
    return "\n".join(lines)


def write_report(report: dict, out: str | Path) -> list[Path]:
    """report.json, report.md and the plots under `out`; returns the paths written."""
    # all or nothing: build every file in a temp dir inside `out`, then rename them into place (renames
    # need no space), so a full disk leaves an earlier report whole and a new `out` not created
    out = Path(out)
    created = [d for d in (out, *out.parents) if not d.exists()]  # removed again on failure
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out, prefix=".report-"))
    try:
        (tmp / "report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        (tmp / "report.md").write_text(markdown(report), encoding="utf-8")
        names = ["report.json", "report.md", *(p.name for p in plot(report, tmp))]
        for name in names:
            os.replace(tmp / name, out / name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if created:
            shutil.rmtree(created[-1], ignore_errors=True)
        raise
    tmp.rmdir()
    return [out / name for name in names]
