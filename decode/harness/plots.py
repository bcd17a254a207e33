"""The evaluation's PNG plots: τ and speedup per row, acceptance by depth, accepted lengths.

`plot` writes each PNG atomically (temp file beside it + rename); decode.harness.report's `write_report`
calls it inside its all-or-nothing temp folder, and report.md links the files PLOTS names.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from decode.harness.labels import OWN_TREES, distinct_labels, drafter_kind, per_conversation_tau

if TYPE_CHECKING:  # matplotlib is imported inside `plot` only: loading the harness stays cheap
    from matplotlib.axes import Axes

# the files `plot` writes, in the order report.md shows them
PLOTS = ("tau.png", "acceptance_by_depth.png", "accepted_lengths.png")


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


def row_color(d: dict) -> str:
    """Trained checkpoints blue, training-free sources orange, HF peers and AR gray."""
    who = drafter_kind(d["spec"], d.get("drafter_kind"))
    if d["kind"] == "hf" or who == "AR":
        return "tab:gray"
    return "tab:orange" if who.partition(":")[0] in (*OWN_TREES, "early-exit", "skip", "draft-model") else "tab:blue"


def spread_bars(
    ax: Axes,
    labels: list[str],
    values: list[float],
    spreads: list[list[float]],
    colors: list[str],
    ref: float,
    fmt_value: str,
    xlabel: str,
) -> None:
    """Horizontal bars (first row on top) with min..max whiskers over conversations and a dashed line at `ref`."""
    y = list(range(len(labels)))
    lo = [v - min(s) if s else 0.0 for v, s in zip(values, spreads)]
    hi = [max(s) - v if s else 0.0 for v, s in zip(values, spreads)]
    ax.barh(
        y,
        values,
        color=colors,
        height=0.65,
        xerr=[[max(0.0, x) for x in lo], [max(0.0, x) for x in hi]],
        error_kw={"ecolor": "black", "elinewidth": 0.9, "capsize": 2.5},
    )
    ax.axvline(ref, color="black", lw=0.9, ls="--", zorder=0)
    right = max([v + h for v, h in zip(values, hi)] + [ref])
    for i, (v, h) in enumerate(zip(values, hi)):
        ax.text(
            v + max(h, 0.0) + 0.015 * right,
            i,
            format(v, fmt_value),
            va="center",
            fontsize=8,
            bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5},
        )  # readable over the AR line
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
    spread_bars(
        ax_t,
        [labels[d["spec"]] for d in ds],
        [d["mean_accepted_tokens"] for d in ds],
        [per_conversation_tau(d) for d in ds],
        colors,
        1.0,
        ".2f",
        "τ (tokens per target pass; AR = 1)",
    )
    spread_bars(
        ax_s,
        [labels[d["spec"]] for d in ds],
        [d["speedup_vs_ar"] for d in ds],
        [d.get("speedup_vs_ar_per_conversation") or [] for d in ds],
        colors,
        1.0,
        ".2f",
        "speedup vs AR (tokens/s; AR = 1.0×)",
    )
    ax_t.invert_yaxis()  # AR on top (the axes share y: invert once)
    st = report["settings"]
    fig.suptitle(
        f"{Path(str(st.get('target'))).name} · {st.get('conversations', st.get('turns'))} conversations · "
        f"{st.get('dtype', '')} · whiskers: min–max over conversations",
        fontsize=10,
    )
    kinds = [("tab:blue", "trained drafter"), ("tab:orange", "training-free"), ("tab:gray", "AR / HF peer")]
    fig.legend(
        handles=[Patch(color=c, label=n) for c, n in kinds if c in colors],
        loc="outside lower center",
        ncol=3,
        frameon=False,
        fontsize=8,
    )
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

    def cmap(
        k: int,
    ) -> str | tuple[float, float, float, float]:  # 0 accepted (the bonus only) in gray, then dark to light
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
        ax.legend(
            handles=handles,
            title="accepted",
            fontsize=8,
            title_fontsize=8,
            loc="upper left",
            bbox_to_anchor=(1.01, 1.0),
            frameon=False,
        )
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
