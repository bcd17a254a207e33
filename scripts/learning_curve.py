"""Learning curves: decoded τ and acceptance by depth of a run's drafter at each saved step, on MT-bench.

Train with a constant learning rate (after warm-up) and keep every checkpoint; then the drafter at step s
is the drafter of an s-step run, and one run gives the whole curve:

    # (a) optimizer steps at fixed data: many epochs over the recipe's 1,024 answers
    python -m train recipes/smollm2-135m/eagle3.yaml run_dir=runs/lc/e3-steps train.steps=2000 \\
        train.schedule=constant train.save_every=125 train.keep_checkpoints=20 train.eval_every=0 train.sim_eval_prompts=0
    # (b) training tokens at a fixed number of epochs (one): a single pass over more answers; the
    #     checkpoint after N trained tokens is a one-epoch run over a random N-token subset (FINDINGS.md,
    #     session 42). Beside it (session 43): the same steps over a fixed 993 of those answers
    #     (train.max_sequences=993), more passes over less data against one pass over more at each step
    python -m train recipes/smollm2-135m/eagle3.yaml run_dir=runs/s42/e3-pass data.max_records=5376 \\
        train.steps=1300 train.schedule=constant train.save_every=80 train.keep_checkpoints=20 ...
    python scripts/learning_curve.py runs/s42/e3-pass --steps 80,160,320,640,1300 --out runs/s42/eval-pass
    # a lever ablation: one run per lever; --base labels each run with the settings it changes
    python scripts/learning_curve.py runs/abl/base runs/abl/noise-none --base runs/abl/base --chains 8 --out runs/abl/curves

For every (run, step): the native drafter (train.snapshot), then greedy decoding of MT-bench first turns
(`--per-category` of each of the 8 categories) as chains of each `--chains` length and the `--tree`, with
τ and acceptance by depth (P(accepted >= d), decode.metrics). Each point is appended to OUT/points.jsonl
as it finishes, so a rerun skips what is done; OUT/curve.md (the table) and OUT/curve.png (τ against
steps and against trained tokens, and depth-2 / depth-1 against steps) are rewritten at the end; with
`--base RUN`, each run is labelled by the settings it changes against RUN (the table's "changes" column, and
its paired τ difference to RUN's point with the standard error over prompts) and
OUT/levers.png shows each run's last point as τ bars. Each point stores its run's config, so a committed
points.jsonl can serve a later ablation on the same data: `--reference FILE` joins its points (never
re-evaluated) and `--base NAME` may name one of its runs:

    python scripts/learning_curve.py runs/s32/ttt5 --reference recipes/smollm2-135m/curves/levers-noise-s31.points.jsonl \
        --base abl-base --chains 8 --out runs/s32/levers
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from decode.generate import encode_prompt, generate
from decode.metrics import GenStats
from decode.harness.prompts import Conversation, first_per_category, load_prompts, render_turn
from decode.sampling import SamplingConfig
from decode.target import Target
from decode.tree import parse_shape
from drafters.registry import make_drafter
from train.checkpoints import CKPT_PREFIX, RUN_STATE, checkpoints
from train.config import Recipe, load_recipe, to_dict
from train.snapshot import snapshot, uses_lora

REPO = Path(__file__).resolve().parents[1]
MT_BENCH = REPO / "recipes/data/mt_bench_question.jsonl"
# The field's small-budget reference (speculators' EAGLE-3 examples: 5k samples x 5 epochs on 8B targets,
# 3 draft tokens): tau 1.45-1.49, acceptance by position ~0.35 / 0.10 / 0.02 (issue 19's survey).
# Settings that say where and how often a run reports, not what it trains: not a lever.
BOOKKEEPING = ("run_dir", "name", "train.save_every", "train.keep_checkpoints", "train.log_every", "train.report_to",
               "train.eval_every", "train.eval_batches", "train.threads", "train.sim_")
FIELD = {"label": "speculators EAGLE-3, 5k samples x 5 epochs, k=3", "tau": (1.45, 1.49), "by_depth": (0.35, 0.10, 0.02)}


def pick_steps(available: list[int], wanted: list[int] | None) -> list[int]:
    """The steps to evaluate: those of `wanted` this run saved (several runs may share one list), or every
    saved step; none of them saved is an error."""
    if not wanted:
        return available
    chosen = [s for s in wanted if s in available]
    if not chosen:
        raise SystemExit(f"error: none of steps {wanted} has a checkpoint (saved: {available}); choose from those")
    return chosen


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
    a, b = {**{k: v for k, v in defaults.items() if k in b}, **a}, {**{k: v for k, v in defaults.items() if k in a}, **b}
    kind, base_kind = a.get("drafter.kind"), b.get("drafter.kind")
    sections = (f"drafter.{kind}.", f"drafter.{base_kind}.") if kind != base_kind else ()
    diff = [f"{k}={a.get(k)}" + (f" (its drafter.{kind} section)" if k == "drafter.kind" else "")
            for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k) and not k.startswith(BOOKKEEPING + sections)]
    return ", ".join(diff) or "(base)"


def trained_tokens(run_dir: Path, step: int) -> int | None:
    """Trained (loss-masked) tokens seen by `step`: the checkpoint's own count (train/checkpoints.py keeps it in
    draftsmith_state.json), else the metrics.jsonl row of that step; None for runs older than the count."""
    state = run_dir / "checkpoints" / f"{CKPT_PREFIX}{step}" / RUN_STATE
    if state.exists() and "trained_tokens" in (s := json.loads(state.read_text())):
        return s["trained_tokens"]
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return next((r["trained_tokens"] for r in rows if r.get("step") == step and "trained_tokens" in r), None)


def prompts(target: Target, convs: list[Conversation]) -> list[torch.Tensor]:
    """Each conversation's first turn, rendered with the target's chat template. Each [1, T]."""
    out = []
    for c in convs:
        text, special = render_turn(target.tokenizer, c.turns[:1], [])
        out.append(encode_prompt(target, text, special))
    return out


def decode_point(target: Target, drafter_dir: Path, ids: list[torch.Tensor], shapes: dict[str, str],
                 max_new_tokens: int, draft_len_of: dict[str, int]) -> dict[str, dict]:
    """τ and acceptance by depth of one drafter for each named shape, over all prompts (greedy)."""
    drafter = make_drafter(str(drafter_dir), target)
    out = {}
    for name, tree in shapes.items():
        shape = parse_shape(tree, draft_len_of.get(name, 8))
        total, per_prompt = GenStats(), []
        for x in ids:
            stats = generate(target, drafter, x, max_new_tokens, SamplingConfig(), shape).stats
            total = total.merge(stats)
            per_prompt.append(stats.tau)
        out[name] = {"tau": total.tau, "by_depth": total.acceptance_by_depth, "new_tokens": total.new_tokens,
                     "per_prompt": per_prompt}
    return out


def ratio(by_depth: list[float]) -> float | None:
    """depth-2 / depth-1 acceptance: how much of the depth-1 acceptance survives one more draft step."""
    return by_depth[1] / by_depth[0] if len(by_depth) > 1 and by_depth[0] > 0 else None


def paired_delta(run: list[float], base: list[float]) -> tuple[float, float]:
    """Mean per-prompt τ difference run - base over the same prompts, and its standard error: the same prompts
    decoded by two drafters differ less than two independent samples would, so this is the spread to read."""
    d = torch.tensor(run, dtype=torch.float64) - torch.tensor(base, dtype=torch.float64)
    se = d.std().item() / len(d) ** 0.5 if len(d) > 1 else float("nan")
    return d.mean().item(), se


def delta_text(p: dict, points: list[dict], shapes: list[str]) -> str:
    """The 'Δ τ vs base' cell of a lever table: per shape, the paired difference to the base run's point at the
    same step (else its last), where both carry per-prompt τ over the same number of prompts."""
    base = sorted((q for q in points if q.get("lever") == "(base)"), key=lambda q: (q["step"] != p["step"], -q["step"]))
    if p.get("lever") == "(base)" or not base:
        return "-"
    cells = []
    for s in shapes:
        a, b = p["shapes"][s].get("per_prompt"), base[0]["shapes"].get(s, {}).get("per_prompt")
        if a and b and len(a) == len(b):
            m, se = paired_delta(a, b)
            cells.append(f"{s} {m:+.3f} ± {se:.3f}")
    other = f" (vs its step {base[0]['step']})" if cells and base[0]["step"] != p["step"] else ""
    return "; ".join(cells) + other if cells else "-"


def write_table(points: list[dict], shapes: list[str], path: Path) -> str:
    """The markdown table of every point, run by run in step order (with levers: what each run changes and its
    paired τ difference to the base run)."""
    levers = any("lever" in p for p in points)
    head = "| run | " + ("changes (vs the base run) | " if levers else "") + "step | trained tokens | " + \
        " | ".join(f"τ {s}" for s in shapes) + " | chain-8 acceptance by depth 1–3 | depth-2 / depth-1 |" + \
        (" Δ τ vs base (paired, ± SE over prompts) |" if levers else "")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for p in sorted(points, key=lambda p: (p["run"], p["step"])):
        c8 = p["shapes"].get("chain-8", {}).get("by_depth", [])
        r = ratio(c8)
        tok = f"{p['trained_tokens']:,}" if p.get("trained_tokens") else "-"
        changes = f"{p.get('lever', '-')} | " if levers else ""
        name = p["run"] + (f" (from {Path(p['reference']).name})" if p.get("reference") else "")
        lines.append(f"| {name} | {changes}{p['step']} | {tok} | " + " | ".join(f"{p['shapes'][s]['tau']:.3f}" for s in shapes)
                     + f" | {', '.join(f'{a:.3f}' for a in c8[:3])} | {'-' if r is None else f'{r:.2f}'} |"
                     + (f" {delta_text(p, points, shapes)} |" if levers else ""))
    lo, hi = FIELD["tau"]
    taus = [f"τ {lo}–{hi} (k=3)"] + [""] * (len(shapes) - 1)  # under the first τ column, whatever the shapes
    lines.append(f"| *{FIELD['label']}* | {'| ' if levers else ''}| | " + " | ".join(taus) + " | "
                 f"{', '.join(str(a) for a in FIELD['by_depth'])} | {FIELD['by_depth'][1] / FIELD['by_depth'][0]:.2f} |"
                 + (" |" if levers else ""))
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


def plot(points: list[dict], shapes: list[str], path: Path) -> None:
    """τ vs optimizer steps, τ vs trained tokens (log x), and depth-2 / depth-1 vs steps; one colour per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = list(dict.fromkeys(p["run"] for p in points))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8), constrained_layout=True)
    styles = ["-", "--", ":", "-."]
    for i, run in enumerate(runs):
        pts = sorted((p for p in points if p["run"] == run), key=lambda p: p["step"])
        color = f"C{i}"
        for j, s in enumerate(shapes):
            y = [p["shapes"][s]["tau"] for p in pts]
            axes[0].plot([p["step"] for p in pts], y, styles[j % 4], color=color, marker="o", label=f"{run} · {s}")
            tok = [(p["trained_tokens"], v) for p, v in zip(pts, y) if p.get("trained_tokens")]
            if tok:
                axes[1].plot(*zip(*tok), styles[j % 4], color=color, marker="o", label=f"{run} · {s}")
        r = [(p["step"], ratio(p["shapes"].get("chain-8", {}).get("by_depth", []))) for p in pts]
        r = [(x, v) for x, v in r if v is not None]
        if r:
            axes[2].plot(*zip(*r), "-", color=color, marker="o", label=run)
    lo, hi = FIELD["tau"]
    for ax in axes[:2]:
        ax.axhspan(lo, hi, color="grey", alpha=0.2, label="speculators 5k-sample τ (k=3)")
        ax.axhline(1.0, color="black", lw=0.8)
    axes[2].axhline(FIELD["by_depth"][1] / FIELD["by_depth"][0], color="grey", ls="--", label="speculators 5k-sample")
    axes[2].axhline(0.25, color="red", ls=":", label="issue 19's aim (0.25)")
    for ax, xl, yl in [(axes[0], "optimizer steps", "τ (tokens per target pass)"),
                       (axes[1], "trained tokens", "τ"), (axes[2], "optimizer steps", "depth-2 / depth-1 (chain 8)")]:
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
    labels = [(f"base: {p['run']}" if p.get("lever") == "(base)" else p.get("lever", p["run"])) + f" (step {p['step']})"
              for p in rows]
    fig, axes = plt.subplots(1, len(shapes), figsize=(5.5 * len(shapes), 0.5 * len(rows) + 1.4),
                             sharey=True, constrained_layout=True, squeeze=False)
    base_pt = next((p for p in rows if p.get("lever") == "(base)"), None)
    for ax, shape in zip(axes[0], shapes):
        taus = [p["shapes"][shape]["tau"] for p in rows]
        colors = ["grey" if p.get("lever") == "(base)" else "C0" for p in rows]
        # whiskers: the paired difference's standard error over prompts (does the lever move τ at all?)
        ref = (base_pt or {}).get("shapes", {}).get(shape, {}).get("per_prompt") or []
        errs = [paired_delta(pp, ref)[1] if p is not base_pt and (pp := p["shapes"][shape].get("per_prompt"))
                and len(pp) == len(ref) > 1 else 0.0 for p in rows]
        ax.barh(range(len(rows)), taus, color=colors, xerr=errs, capsize=3)
        for i, (t, e) in enumerate(zip(taus, errs)):
            ax.text(t + e, i, f" {t:.3f}", va="center", fontsize=8)
        base = [p["shapes"][shape]["tau"] for p in rows if p.get("lever") == "(base)"]
        if base:
            ax.axvline(base[0], color="black", lw=0.8, ls="--")
        ax.set_xlim(1.0, max(taus) * 1.08)
        ax.set_title(f"τ {shape}")
        ax.grid(axis="x", alpha=0.3)
    fig.supxlabel("τ (dashed: the base run); whiskers: ± SE of the paired τ difference to the base, over prompts",
                  fontsize=8)
    axes[0][0].set_yticks(range(len(rows)), labels, fontsize=8)
    axes[0][0].invert_yaxis()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="training run directories (checkpoints kept at the curve's steps)")
    ap.add_argument("--out", required=True, help="points.jsonl, curve.md and curve.png go here")
    ap.add_argument("--steps", default="", help="comma-separated steps to evaluate where a run saved them "
                                                "(default: every saved one)")
    ap.add_argument("--prompts", default=str(MT_BENCH), help="a prompt file (decode.harness.prompts forms)")
    ap.add_argument("--per-category", type=int, default=2, help="first N conversations of each category")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--chains", default="3,8", help="chain lengths k")
    ap.add_argument("--tree", default="dynamic:topk=8,depth=6,nodes=24")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--base", default="", help="a run directory, or the name of a --reference run: label each run "
                                               "with the settings it changes against this one (a lever ablation)")
    ap.add_argument("--reference", action="append", default=[], metavar="POINTS",
                    help="an earlier points.jsonl (e.g. a committed one) whose points join the table and plots; "
                         "repeatable. For an ablation against a run trained in another session on the same data")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wanted = [int(s) for s in args.steps.split(",") if s.strip()]
    chains = [int(k) for k in args.chains.split(",") if k.strip()]
    shapes = {**{f"chain-{k}": "chain" for k in chains}, "tree": args.tree}
    draft_len_of = {f"chain-{k}": k for k in chains}
    # 1. what to evaluate, and what an earlier run of this script already did.
    plan = []
    for run in map(Path, args.runs):
        saved = [int(p.name[len(CKPT_PREFIX):]) for p in checkpoints(run)]
        if not saved:
            print(f"error: {run}: no checkpoints (train with train.keep_checkpoints large enough)", file=sys.stderr)
            return 2
        plan += [(run, s) for s in pick_steps(saved, wanted)]
    log = out / "points.jsonl"
    points = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    own = {p["run"] for p in points} | {run.name for run, _ in plan}
    points += [p for p in read_references(args.reference) if p["run"] not in own]  # this call's runs win
    done = {(p["run"], p["step"]) for p in points}
    for p in points:  # a count the run's checkpoints hold but an older version of this script did not read
        run = next((Path(r) for r in args.runs if Path(r).name == p["run"]), None)
        if p.get("trained_tokens") is None and run is not None:
            p["trained_tokens"] = trained_tokens(run, p["step"])
    base = base_config(args.base, points) if args.base else None
    for p in points if base is not None else []:  # labels follow the --base of this call
        run = next((Path(r) for r in args.runs if Path(r).name == p["run"]), None)
        config = yaml_of(run) if run is not None else p.get("config")
        if config is not None:
            p["lever"] = lever(config, base)
    convs = first_per_category(load_prompts(args.prompts), args.per_category)
    # 2. one target for every point; each drafter decodes the same first turns.
    target = Target.load(run_target(Path(args.runs[0])), dtype=args.dtype)
    ids = prompts(target, convs)
    todo = sum((run.name, step) not in done for run, step in plan)
    print(f"{todo} of {len(plan)} points to decode ({len(points)} read), {len(convs)} prompts x "
          f"{args.max_new_tokens} tokens, {target.dtype}, shapes {shapes}", file=sys.stderr)
    for run, step in plan:
        if (run.name, step) in done:
            continue
        snap = snapshot(run, step, run / "snapshots" / f"{CKPT_PREFIX}{step}", target)
        # a LayerSkip-LoRA drafter adapts the target it is built on: a fresh target for each of those
        t = Target.load(run_target(run), dtype=args.dtype) if uses_lora(load_recipe(run / "config.yaml")) else target
        res = decode_point(t, snap, ids, shapes, args.max_new_tokens, draft_len_of)
        config = yaml_of(run)  # stored: the points file describes its runs, and a later --reference reads it
        point = {"run": run.name, "step": step, "trained_tokens": trained_tokens(run, step), "shapes": res,
                 "config": config, **({"lever": lever(config, base)} if base is not None else {}),
                 "prompts": len(ids), "max_new_tokens": args.max_new_tokens, "dtype": str(target.dtype)}
        points.append(point)
        with log.open("a") as f:
            f.write(json.dumps(point) + "\n")
        print(f"{run.name} step {step}: " + ", ".join(f"{k} {v['tau']:.3f}" for k, v in res.items()), file=sys.stderr)
    # 3. the table and the figure.
    print(write_table(points, list(shapes), out / "curve.md"))
    plot(points, list(shapes), out / "curve.png")
    if base is not None:
        plot_levers([p for p in points if "lever" in p], list(shapes), out / "levers.png")
    print(f"wrote {out / 'curve.md'} and {out / 'curve.png'}" + (" and levers.png" if base is not None else ""),
          file=sys.stderr)
    return 0


def read_references(paths: list[str]) -> list[dict]:
    """The points of earlier points.jsonl files, each marked `reference` (they are shown, never re-evaluated)."""
    out = []
    for path in map(Path, paths):
        if not path.is_file():
            raise SystemExit(f"error: --reference {path}: no such file (a points.jsonl this script wrote)")
        out += [{**json.loads(line), "reference": str(path)} for line in path.read_text().splitlines() if line.strip()]
    return out


def base_config(base: str, points: list[dict]) -> dict:
    """--base: a run directory's config.yaml, else the stored config of the reference run of that name."""
    if Path(base, "config.yaml").exists() or "/" in base:
        return yaml_of(Path(base))
    config = next((p.get("config") for p in points if p["run"] == base and p.get("config")), None)
    if config is None:
        raise SystemExit(f"error: --base {base}: neither a run directory nor a --reference run with a stored config")
    return config


def yaml_of(run: Path) -> dict:
    """A run's resolved config (its config.yaml); a directory without one is an error that says so."""
    import yaml

    path = run / "config.yaml"
    if not path.exists():
        raise SystemExit(f"error: {run} has no config.yaml: pass a training run directory")
    return yaml.safe_load(path.read_text())


def run_target(run: Path) -> str:
    """The target directory a run trained on (its config.yaml's `target`)."""
    return yaml_of(run)["target"]


if __name__ == "__main__":
    sys.exit(main())
