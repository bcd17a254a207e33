"""The evaluation report: report.json (DESIGN §6), report.md and PNG plots, plus the cost model.

Everything here is a pure function of the per-turn results `decode.evaluate` collects, except
the writers, which write each file atomically (temp file in the same directory + rename) so an
interrupted run never leaves a half-written report.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from decode.harness.labels import OWN_TREES, distinct_labels, drafter_kind, per_conversation_tau
from decode.metrics import GenStats

COST_FORMULA = ("time_per_token = (T + d) / tau, speedup_vs_ar = (T + d_ar) / time_per_token, where T is the "
                "given target-pass cost in seconds, tau the measured mean accepted tokens per target pass, "
                "d = (draft_s + commit_s) / target_forward_passes the measured drafting and bookkeeping seconds "
                "per target pass on this machine, and d_ar the same for the AR run; assumes one target pass costs T "
                "whatever the draft size (memory-bound target)")
PLOTS = ("tau.png", "acceptance_by_depth.png", "accepted_lengths.png")


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
        rows.append({"target_pass_s": T, "draft_s_per_pass": d, "time_per_token_s": per_token,
                     "speedup_vs_ar": (T + d_ar) / per_token})
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
    return {"prompts": len(turns), "new_tokens": s.new_tokens, "target_forward_passes": s.target_passes,
            "drafter_forward_passes": s.drafter_passes, "wall_time_s": s.wall_s,
            "mean_accepted_tokens": s.tau, "tokens_per_s": s.tokens_per_s,
            "matches_ar": None if matches is None else all(matches)}


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
    entry["per_category"] = {c: group_row([run.turns[i] for i in idx], None if matches is None else
                                          [matches[i] for i in idx]) for c, idx in categories.items()}
    entry["prompts"] = [{"id": t.id, "category": t.category, "turn": t.turn, "prompt_tokens": t.prompt_tokens,
                         **group_row([t], None if matches is None else [matches[i]])}
                        for i, t in enumerate(run.turns)]
    for row in entry["prompts"]:
        del row["prompts"]
    return entry


def build_report(runs: list[SpecRun], settings: dict, pass_costs: list[float]) -> dict:
    """report.json: settings, the cost-model formula, and one entry per run (runs[0] is the AR reference)."""
    ar = runs[0]
    greedy = settings.get("temperature", 0.0) == 0.0
    return {"settings": settings, "cost_model": {"formula": COST_FORMULA, "target_pass_s": pass_costs},
            "drafters": [drafter_entry(r, ar, greedy, pass_costs) for r in runs]}


# --- writing ----------------------------------------------------------------------------


def atomic_write(path: Path, write: Callable[[str], None]) -> None:
    """Call write(tmp_path) on a temp file next to `path`, then rename it into place."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def fmt(x, spec: str = ".2f") -> str:
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
    lines = ["# draftsmith evaluation", "",
             f"target `{st.get('target')}` · prompts `{st.get('prompts')}` ({st.get('turns')} turns) · "
             f"max_new_tokens {st.get('max_new_tokens')} · temperature {st.get('temperature')} · "
             f"tree `{st.get('tree')}` · draft_len {st.get('draft_len')} · policy `{st.get('policy')}`", "",
             "| row | SPEC | τ | tokens/s | speedup vs AR | matches AR | target passes | drafter passes | "
             "draft / verify / commit s | " + " | ".join(f"proj. speedup @ {c:g} s" for c in costs) + " |",
             "|---" * (9 + len(costs)) + "|"]
    for d in ds:
        split = d["time_split_s"]
        split_s = " / ".join(f"{split[k]:.2f}" for k in ("draft", "verify", "commit")) if split else "–"
        proj = [fmt(r["speedup_vs_ar"]) for r in d["cost_model"]] if d["cost_model"] else ["–"] * len(costs)
        lines.append(f"| {label[d['spec']]} | `{d['name']}` | {d['mean_accepted_tokens']:.3f} | {d['tokens_per_s']:.1f} | "
                     f"{d['speedup_vs_ar']:.2f} | {fmt(d['matches_ar'])} | {d['target_forward_passes']} | "
                     f"{d['drafter_forward_passes']} | {split_s} | " + " | ".join(proj) + " |")
    lines += ["", f"Cost model: {report['cost_model']['formula']}.", ""]
    cats = list(dict.fromkeys(c for d in ds for c in d["per_category"]))
    lines += ["## τ per category", "", "| drafter | " + " | ".join(cats) + " |", "|---" * (len(cats) + 1) + "|"]
    for d in ds:
        row = [fmt(d["per_category"][c]["mean_accepted_tokens"], ".3f") if c in d["per_category"] else "–"
               for c in cats]
        lines.append(f"| {label[d['spec']]} | " + " | ".join(row) + " |")
    depth = max((len(d["acceptance_by_depth"] or []) for d in ds), default=0)
    if depth:
        lines += ["", "## Acceptance by depth (P(accepted ≥ d | drafted to depth d))", "",
                  "| drafter | " + " | ".join(f"d{i + 1}" for i in range(depth)) + " |", "|---" * (depth + 1) + "|"]
        for d in ds:
            acc = d["acceptance_by_depth"] or []
            if acc:
                lines.append(f"| {label[d['spec']]} | " + " | ".join(fmt(a) for a in acc) + " |" * (1 + depth - len(acc)))
    autos = [d for d in ds if d.get("auto")]
    if autos:
        lines += ["", "## --tree auto: predicted vs measured", "",
                  "Predicted from the calibrated acceptance by (depth, rank) and the pass-cost curve measured in this "
                  "run (decode.harness.autoshape); τ predicted per round, measured over the run (prefill pass included).", "",
                  "| row | shape chosen | τ predicted | τ measured | speedup predicted | speedup measured | calibration |",
                  "|---|---|---|---|---|---|---|"]
        for d in autos:
            a = d["auto"]
            src = ("cached " if a["calibration_cached"] else "") + (f"`{a['calibration']}`" if a["calibration"] else "–")
            lines.append(f"| {label[d['spec']]} | `{a['shape']}` | {fmt(a['predicted_tau'])} | {fmt(a['measured_tau'])} | "
                         f"{fmt(a['predicted_speedup_vs_ar'])} | {fmt(a['measured_speedup_vs_ar'])} | {src} |")
    lines += ["", *[f"![{p[:-4]}]({p})" for p in PLOTS], ""]
    return "\n".join(lines)


def row_color(d: dict) -> str:
    """Trained checkpoints blue, training-free sources orange, HF peers and AR gray."""
    who = drafter_kind(d["spec"], d.get("drafter_kind"))
    if d["kind"] == "hf" or who == "AR":
        return "tab:gray"
    return "tab:orange" if who.partition(":")[0] in (*OWN_TREES, "early-exit", "skip", "draft-model") else "tab:blue"


def spread_bars(ax, labels: list[str], values: list[float], spreads: list[list[float]], colors: list[str],
                ref: float, fmt_value: str, xlabel: str) -> None:
    """Horizontal bars (first row on top) with min..max whiskers over conversations and a dashed line at `ref`."""
    y = list(range(len(labels)))
    lo = [v - min(s) if s else 0.0 for v, s in zip(values, spreads)]
    hi = [max(s) - v if s else 0.0 for v, s in zip(values, spreads)]
    ax.barh(y, values, color=colors, height=0.65, xerr=[[max(0.0, x) for x in lo], [max(0.0, x) for x in hi]],
            error_kw={"ecolor": "black", "elinewidth": 0.9, "capsize": 2.5})
    ax.axvline(ref, color="black", lw=0.9, ls="--", zorder=0)
    right = max([v + h for v, h in zip(values, hi)] + [ref])
    for i, (v, h) in enumerate(zip(values, hi)):
        ax.text(v + max(h, 0.0) + 0.015 * right, i, format(v, fmt_value), va="center", fontsize=8,
                bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5})  # readable over the AR line
    ax.set_xlim(0, right * 1.18)
    ax.set_yticks(y, labels)
    ax.set_xlabel(xlabel)
    ax.grid(axis="x", alpha=0.3)


def plot(report: dict, out: Path) -> list[Path]:
    """τ and speedup per row (horizontal bars, whiskers = spread over conversations), acceptance by depth,
    accepted lengths (PNG, Agg backend). Rows carry short labels (row_label); report.md has the full SPECs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ds = report["drafters"]
    labels = distinct_labels(ds)
    drafted = [d for d in ds if d["acceptance_by_depth"]]
    figs = []

    # 1. τ | speedup, one row per drafter, AR first
    colors = [row_color(d) for d in ds]
    fig, (ax_t, ax_s) = plt.subplots(1, 2, sharey=True, figsize=(10, 0.4 * len(ds) + 1.5), layout="constrained")
    spread_bars(ax_t, [labels[d["spec"]] for d in ds], [d["mean_accepted_tokens"] for d in ds],
                [per_conversation_tau(d) for d in ds], colors, 1.0, ".2f", "τ (tokens per target pass; AR = 1)")
    spread_bars(ax_s, [labels[d["spec"]] for d in ds], [d["speedup_vs_ar"] for d in ds],
                [d.get("speedup_vs_ar_per_conversation") or [] for d in ds], colors, 1.0, ".2f",
                "speedup vs AR (tokens/s; AR = 1.0×)")
    ax_t.invert_yaxis()  # AR on top (the axes share y: invert once)
    st = report["settings"]
    fig.suptitle(f"{Path(str(st.get('target'))).name} · {st.get('conversations', st.get('turns'))} conversations · "
                 f"{st.get('dtype', '')} · whiskers: min–max over conversations", fontsize=10)
    kinds = [("tab:blue", "trained drafter"), ("tab:orange", "training-free"), ("tab:gray", "AR / HF peer")]
    fig.legend(handles=[Patch(color=c, label=n) for c, n in kinds if c in colors], loc="outside lower center",
               ncol=3, frameon=False, fontsize=8)
    figs.append((fig, "tau.png"))

    # 2. acceptance by depth: one line per drafted row (a colour per drafter, the line style by shape:
    #    chain solid, tree dashed, auto dotted), the legend beside the axes
    fig, ax = plt.subplots(figsize=(9, 4.2))
    palette = plt.get_cmap("tab10").colors
    kinds = list(dict.fromkeys(drafter_kind(d["spec"], d.get("drafter_kind")) for d in drafted))
    for d in drafted:
        acc = d["acceptance_by_depth"]
        style = ":" if d.get("auto") else "-" if (d.get("shape") or "chain").startswith("chain") else "--"
        color = palette[kinds.index(drafter_kind(d["spec"], d.get("drafter_kind"))) % len(palette)]
        ax.plot(range(1, len(acc) + 1), acc, marker="o", ms=4, ls=style, color=color, label=labels[d["spec"]])
    ax.set_xlabel("draft depth d")
    ax.set_ylabel("P(accepted ≥ d | drafted to d)")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.set_title("Acceptance by depth")
    if drafted:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False)
    else:
        ax.text(0.5, 0.5, "no drafts in this run", ha="center", transform=ax.transAxes)
    figs.append((fig, "acceptance_by_depth.png"))

    # 3. accepted lengths: per row, the share of rounds that accepted 0, 1, 2, ... draft tokens (stacked)
    fig, ax = plt.subplots(figsize=(10, 0.42 * max(1, len(drafted)) + 1.6))
    longest = max((len(d["accepted_length_histogram"]) for d in drafted), default=0)
    viridis = plt.get_cmap("viridis", max(2, longest - 1))

    def cmap(k: int):  # 0 accepted (the bonus only) in gray, then dark to light
        return "0.82" if k == 0 else viridis(k - 1)

    for i, d in enumerate(drafted):
        h = d["accepted_length_histogram"]
        n, left = sum(h) or 1, 0.0
        for k, c in enumerate(h):
            ax.barh(i, c / n, left=left, color=cmap(k), height=0.65)
            left += c / n
    ax.set_yticks(range(len(drafted)), [labels[d["spec"]] for d in drafted])
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of rounds")
    ax.set_title("Accepted draft tokens per round")
    if drafted:
        handles = [Patch(color=cmap(k), label=str(k)) for k in range(longest)]
        ax.legend(handles=handles, title="accepted", fontsize=8, title_fontsize=8, loc="upper left",
                  bbox_to_anchor=(1.01, 1.0), frameon=False)
    else:
        ax.text(0.5, 0.5, "no drafts in this run", ha="center", transform=ax.transAxes)
    figs.append((fig, "accepted_lengths.png"))

    paths = []
    for fig, name in figs:
        if fig.get_layout_engine() is None:
            fig.tight_layout()
        atomic_write(out / name, lambda tmp, fig=fig: fig.savefig(tmp, format="png", dpi=100))
        plt.close(fig)
        paths.append(out / name)
    return paths

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
