"""The figures of scripts/learning_curve.py: OUT/curve.png (τ against steps and trained tokens, the depth
ratio) and, for a lever ablation, OUT/levers.png (each run's last τ as a bar) and OUT/seeds.png (per-seed paired Δ τ).
Points as in curve_points.py.
"""

from __future__ import annotations

import re
from pathlib import Path

from scripts.curve_points import FIELD, chain_depths, paired_delta, ratio


def plot(points: list[dict], shapes: list[str], path: Path) -> None:
    """τ vs optimizer steps, τ vs trained tokens (log x), and depth-2 / depth-1 vs steps; one colour per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = list(dict.fromkeys(p["run"] for p in points))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8), constrained_layout=True)
    styles = ["-", "--", ":", "-."]
    for i, run in enumerate(runs):
        pts_all = sorted((p for p in points if p["run"] == run), key=lambda p: p["step"])
        color = f"C{i}"
        for j, s in enumerate(shapes):
            pts = [p for p in pts_all if s in p["shapes"]]  # a run may lack a shape (a block drafter: no chain-8)
            if not pts:
                continue
            y = [p["shapes"][s]["tau"] for p in pts]
            axes[0].plot([p["step"] for p in pts], y, styles[j % 4], color=color, marker="o", label=f"{run} · {s}")
            tok = [(p["trained_tokens"], v) for p, v in zip(pts, y) if p.get("trained_tokens")]
            if tok:
                axes[1].plot(*zip(*tok), styles[j % 4], color=color, marker="o", label=f"{run} · {s}")
        r = [(p["step"], ratio(chain_depths(p))) for p in pts_all]
        r = [(x, v) for x, v in r if v is not None]
        if r:
            axes[2].plot(*zip(*r), "-", color=color, marker="o", label=run)
    lo, hi = FIELD["tau"]
    for ax in axes[:2]:
        ax.axhspan(lo, hi, color="grey", alpha=0.2, label="speculators 5k-sample τ (k=3)")
        ax.axhline(1.0, color="black", lw=0.8)
    axes[2].axhline(FIELD["by_depth"][1] / FIELD["by_depth"][0], color="grey", ls="--", label="speculators 5k-sample")
    axes[2].axhline(0.25, color="red", ls=":", label="issue 19's aim (0.25)")
    for ax, xl, yl in [
        (axes[0], "optimizer steps", "τ (tokens per target pass)"),
        (axes[1], "trained tokens", "τ"),
        (axes[2], "optimizer steps", "depth-2 / depth-1 (longest chain)"),
    ]:
        ax.set_xscale("log")
        ax.set_xlabel(xl)
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
    axes[0].set_title("τ against steps")
    axes[1].set_title("τ against trained tokens")
    axes[2].set_title("the depth collapse closing")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=min(4, len(labels)), fontsize=8)
    h2, l2 = axes[2].get_legend_handles_labels()
    axes[2].legend(h2, l2, fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_levers(points: list[dict], shapes: list[str], path: Path) -> None:
    """A lever ablation at a glance: each run's last point as a horizontal τ bar per shape, labelled by what it
    changes, with the base run's τ as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    last = {}
    for p in sorted(points, key=lambda p: p["step"]):
        last[p["run"]] = p
    rows = sorted(last.values(), key=lambda p: p.get("lever") != "(base)")  # the base on top
    labels = [
        (f"base: {p['run']}" if p.get("lever") == "(base)" else p.get("lever", p["run"])) + f" (step {p['step']})"
        for p in rows
    ]
    fig, axes = plt.subplots(
        1,
        len(shapes),
        figsize=(5.5 * len(shapes), 0.5 * len(rows) + 1.4),
        sharey=True,
        constrained_layout=True,
        squeeze=False,
    )
    base_pt = next((p for p in rows if p.get("lever") == "(base)"), None)
    for ax, shape in zip(axes[0], shapes):
        taus = [p["shapes"][shape]["tau"] for p in rows]
        colors = ["grey" if p.get("lever") == "(base)" else "C0" for p in rows]
        # whiskers: the paired difference's standard error over prompts (does the lever move τ at all?)
        ref = (base_pt or {}).get("shapes", {}).get(shape, {}).get("per_prompt") or []
        errs = [
            paired_delta(pp, ref)[1]
            if p is not base_pt and (pp := p["shapes"][shape].get("per_prompt")) and len(pp) == len(ref) > 1
            else 0.0
            for p in rows
        ]
        ax.barh(range(len(rows)), taus, color=colors, xerr=errs, capsize=3)
        for i, (t, e) in enumerate(zip(taus, errs)):
            ax.text(t + e, i, f" {t:.3f}", va="center", fontsize=8)
        base = [p["shapes"][shape]["tau"] for p in rows if p.get("lever") == "(base)"]
        if base:
            ax.axvline(base[0], color="black", lw=0.8, ls="--")
        ax.set_xlim(1.0, max(taus) * 1.08)
        ax.set_title(f"τ {shape}")
        ax.grid(axis="x", alpha=0.3)
    fig.supxlabel(
        "τ (dashed: the base run); whiskers: ± SE of the paired τ difference to the base, over prompts", fontsize=8
    )
    axes[0][0].set_yticks(range(len(rows)), labels, fontsize=8)
    axes[0][0].invert_yaxis()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_seed_pairs(pairs: dict[str, dict[str, list[tuple[int, float, float]]]], shapes: list[str], path: Path) -> None:
    """Levers run at several seeds: each seed's paired Δ τ against the base run of that seed (± SE over
    prompts), one marker per seed, one panel per shape; a lever that pays sits right of zero at every seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(pairs)
    # one setting a line ("a=[1, 2], b=x" splits before "b="), without the long key prefix
    labels = ["\n".join(re.split(r", (?=[\w.]+=)", n.replace("drafter.eagle3.", ""))) for n in names]
    seeds = sorted({seed for g in pairs.values() for rows in g.values() for seed, _, _ in rows})
    fig, axes = plt.subplots(
        1, len(shapes), figsize=(4.5 * len(shapes) + 2, 1.0 * len(names) + 1.4), sharey=True, squeeze=False
    )
    for ax, shape in zip(axes[0], shapes):
        for j, seed in enumerate(seeds):
            rows = [(i, d, se) for i, n in enumerate(names) for s, d, se in pairs[n][shape] if s == seed]
            offset = (j - (len(seeds) - 1) / 2) * 0.18
            ax.errorbar(
                [d for _, d, _ in rows],
                [i + offset for i, _, _ in rows],
                xerr=[se for _, _, se in rows],
                fmt="o",
                capsize=3,
                label=f"seed {seed}",
            )
        ax.axvline(0, color="black", lw=0.8)
        ax.set_title(f"Δ τ {shape}, paired with its seed's base")
        ax.grid(axis="x", alpha=0.3)
    axes[0][0].set_yticks(range(len(names)), labels, fontsize=8)
    axes[0][0].invert_yaxis()
    axes[0][-1].legend(fontsize=8)
    fig.supxlabel("Δ τ against the base run trained at the same seed (± SE over prompts)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
