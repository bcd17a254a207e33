"""The facts of an export's model card (drafters/serving/model_card.py), read from what was recorded.

Sources, all optional: the native checkpoint's config.json (the recipe it was trained with, the target, the
capture ids), the run directory it came from (RUN_DIR/export: metrics.jsonl — trained tokens, the last
evaluation's eval/sim_tau_* row —, final_eval.json, and a report.json of `python -m decode.evaluate` if one
was written there), and the target's own README front matter or LICENSE for its licence. Whatever is not
recorded is left out of the card: a card that guesses would be worse than a short one.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from drafters.serving.layouts.rules import engine_default_ids
from drafters.serving.model_card import CardFacts, Evaluation

# The files `fetch:NAME` data sources resolve to under the data home (train/data/sharegpt.py's DATA_FILES): a card
# names the source as the recipe did, not by the path it had on the machine that trained the drafter.
FETCHED = {"sharegpt/sharegpt.jsonl": "fetch:sharegpt", "sharegpt/first_turns.jsonl": "fetch:sharegpt-first-turns"}
RUN_FILES = ("metrics.jsonl", "config.yaml", "final_eval.json")  # what makes a directory a training run's
LICENCE_FIRST_LINES = {
    "mit license": "mit",
    "apache license": "apache-2.0",
    "bsd 3-clause": "bsd-3-clause",
    "bsd 2-clause": "bsd-2-clause",
}


def run_dir_of(ckpt: Path) -> Path | None:
    """The run directory a native checkpoint was exported into (RUN_DIR/export), or None."""
    parent = ckpt.parent
    return parent if ckpt.name == "export" and any((parent / f).is_file() for f in RUN_FILES) else None


def read_rows(path: Path) -> list[dict]:
    """metrics.jsonl rows (a line that is not a JSON object — a write cut short — is skipped)."""
    out = []
    for line in path.read_text(errors="replace").splitlines() if path.is_file() else []:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            out.append(row)
    return out


def read_object(path: Path) -> dict | None:
    try:
        raw = json.loads(path.read_text()) if path.is_file() else None
    except ValueError:
        return None
    return raw if isinstance(raw, dict) else None


def target_license(model_dir: Path | None) -> str | None:
    """The target's licence: its README front matter's `license`, else a LICENSE file's well-known first
    line ("other" for another text); None when the directory records neither."""
    if model_dir is None:
        return None
    readme = model_dir / "README.md"
    text = readme.read_text(errors="replace") if readme.is_file() else ""
    if text.startswith("---"):
        head = text[3:].split("\n---", 1)[0]
        try:
            meta = yaml.safe_load(head)
        except yaml.YAMLError:
            meta = None
        if isinstance(meta, dict) and isinstance(meta.get("license"), str):
            return meta["license"]
    licence = model_dir / "LICENSE"
    if licence.is_file():
        first = next((ln.strip().lower() for ln in licence.read_text(errors="replace").splitlines() if ln.strip()), "")
        return next((v for k, v in LICENCE_FIRST_LINES.items() if first.startswith(k)), "other")
    return None


def source_name(source: str) -> str:
    """A data source as a recipe names it: a fetched file's `fetch:NAME`, anything else as recorded."""
    return next((name for tail, name in FETCHED.items() if Path(source).as_posix().endswith("/" + tail)), source)


def data_rows(recipe: dict) -> tuple[tuple[str, str], ...]:
    """The recipe's data section: where the text came from, how much, and who wrote the answers."""
    d, out = recipe.get("data") or {}, []
    regen = d.get("regenerate") or {}
    source = d.get("source")
    if source:
        names = [source_name(str(x)) for x in (source if isinstance(source, list) else [source])]
        out.append(("source", ", ".join(names)))
        n = d.get("max_records") or 0
        out.append(("records", f"the first {n:,} records of the source" if n else "every record of the source"))
    elif regen.get("num_samples"):
        out.append(("source", f"none: {regen['num_samples']:,} sequences the target sampled from its start token"))
    if d.get("max_length"):
        out.append(("sequence length", f"at most {d['max_length']:,} tokens ({d.get('overflow', 'truncate')})"))
    if d.get("held_out") is not None:
        out.append(("held out for evaluation", f"{d['held_out']:.0%} of the sequences"))
    if regen.get("enabled"):
        t = regen.get("temperature", 1.0)
        how = "greedy" if t == 0 else f"temperature {t:g}, top-p {regen.get('top_p', 1.0):g}"
        out.append(
            (
                "regeneration",
                f"every answer written by the target itself ({how}, at most "
                f"{regen.get('max_new_tokens', 0):,} new tokens, engine {regen.get('engine', 'auto')})",
            )
        )
    elif "regenerate" in d:
        out.append(("regeneration", "none: trained on the source's own answers"))
    return tuple(out)


def steps_time_s(rows: list[dict]) -> float:
    """Seconds spent in training steps, summed over metrics.jsonl's logged windows (each window's trained tokens
    over its tokens_per_s); evaluations, checkpoints and data preparation are not in it."""
    total, seen = 0.0, 0
    for r in rows:
        if (
            isinstance(r.get("trained_tokens"), int)
            and isinstance(r.get("tokens_per_s"), (int, float))
            and r["tokens_per_s"] > 0
        ):
            total += max(0, r["trained_tokens"] - seen) / float(r["tokens_per_s"])
            seen = r["trained_tokens"]
    return total


def duration(s: float) -> str:
    h, m = divmod(round(s) // 60, 60)
    return f"{h} h {m} min" if h else f"{m} min {round(s) % 60} s"


def training_rows(recipe: dict, rows: list[dict], kind: str) -> tuple[tuple[str, str], ...]:
    """The recipe's optimisation settings and what metrics.jsonl recorded of the run."""
    t, out = recipe.get("train") or {}, []
    if recipe.get("name"):
        out.append(("recipe", f"{recipe['name']} (seed {recipe.get('seed', 0)})"))
    steps = max((r["step"] for r in rows if "loss" in r and isinstance(r.get("step"), int)), default=None)
    if steps is not None or t.get("steps"):
        out.append(("steps", f"{steps if steps is not None else t['steps']:,} optimizer steps"))
    if t.get("batch_size"):
        out.append(
            (
                "batch",
                f"{t['batch_size']} sequences per process per micro-batch x {t.get('grad_accum', 1)} "
                "accumulation step(s)",
            )
        )
    if t.get("optimizer"):
        out.append(
            (
                "optimizer",
                f"{t['optimizer']}, peak lr {float(t.get('lr', 0)):g}, {t.get('schedule', 'cosine')} "
                f"schedule after {t.get('warmup_steps', 0)} warmup steps",
            )
        )
    settings = (recipe.get("drafter") or {}).get(kind)
    if settings:
        # an empty list is a default the target fills in (capture ids: the target rows give them)
        out.append(("drafter settings", ", ".join(f"{k}={v}" for k, v in settings.items() if v != [])))
    trained = [r["trained_tokens"] for r in rows if isinstance(r.get("trained_tokens"), int)]
    if trained:
        out.append(("trained tokens", f"{trained[-1]:,} (loss-masked tokens, all processes)"))
    mp = t.get("mixed_precision")
    if mp:
        out.append(("precision", {"bf16": "bf16 autocast (fp32 weights)", "no": "fp32"}.get(mp, mp)))
    if t.get("threads"):
        out.append(("threads", f"{t['threads']} per process"))
    spent = steps_time_s(rows)
    if spent > 0:
        out.append(
            (
                "time in training steps",
                f"{duration(spent)} (metrics.jsonl's logged windows; evaluations, "
                "checkpoints and data preparation not included)",
            )
        )
    if t.get("init_from"):
        out.append(("warm start", str(t["init_from"])))
    return tuple(out)


def sim_evaluation(row: dict, recipe: dict, source: str) -> Evaluation:
    """The decoding-faithful τ of a training run's evaluation row (train/simeval.py's eval/sim_* keys)."""
    t = recipe.get("train") or {}
    prompts = f"prompts of {t['sim_prompts']}" if t.get("sim_prompts") else "held-out prompts"
    setting = (
        f"{row.get('eval/sim_prompts', '?')} {prompts}, greedy, {t.get('sim_max_new_tokens', '?')} new "
        f"tokens, draftsmith's decoder at step {row.get('step', '?')}."
    )
    rows = tuple(
        (shape, f"{row[key]:.2f}", "")
        for shape, key in (
            (f"chain k={t.get('sim_chain', '?')}", "eval/sim_tau_chain"),
            (f"tree {t.get('sim_tree', '?')}", "eval/sim_tau_tree"),
        )
        if isinstance(row.get(key), (int, float))
    )
    notes = []
    depth = row.get("eval/sim_accept_by_depth_chain")
    if isinstance(depth, list) and depth and all(isinstance(a, (int, float)) for a in depth):
        notes.append("acceptance by depth (chain): " + ", ".join(f"{a:.3f}" for a in depth[:8]))
    if isinstance(row.get("eval/sim_matches_ar"), (int, float)):
        notes.append(f"output identical to plain decoding: {row['eval/sim_matches_ar']:.0%} of the decodes")
    if isinstance(row.get("eval/loss"), (int, float)):
        notes.append(f"held-out loss {row['eval/loss']:.4f}")
    return Evaluation("Held-out decoding, the run's last evaluation", setting, rows, tuple(notes), source)


def report_evaluation(report: dict, source: str) -> Evaluation | None:
    """The τ table of a decode.evaluate report.json (None when it has no drafter rows)."""
    st, entries = report.get("settings") or {}, report.get("drafters") or []
    rows = tuple(
        (
            str(e.get("spec") or e.get("name")),
            f"{e['mean_accepted_tokens']:.2f}",
            f"{e['speedup_vs_ar']:.2f}x" if isinstance(e.get("speedup_vs_ar"), (int, float)) else "",
        )
        for e in entries
        if isinstance(e, dict) and isinstance(e.get("mean_accepted_tokens"), (int, float))
    )
    if not rows:
        return None
    setting = (
        f"`python -m decode.evaluate` on {st.get('prompts', '?')} ({st.get('turns', '?')} turns), "
        f"{st.get('max_new_tokens', '?')} new tokens, temperature {st.get('temperature', '?')}."
    )
    return Evaluation("decode.evaluate report", setting, rows, (), source)


def run_evaluations(run: Path | None, recipe: dict) -> tuple[Evaluation, ...]:
    """The run's recorded evaluations: its last eval/sim_tau_* row, and a report.json in the run directory."""
    if run is None:
        return ()
    out = []
    evals = [r for r in read_rows(run / "metrics.jsonl") if "eval/sim_tau_chain" in r or "eval/sim_tau_tree" in r]
    final = read_object(run / "final_eval.json")
    if evals:
        out.append(sim_evaluation(evals[-1], recipe, f"{run / 'metrics.jsonl'} (its last eval/sim_tau_* row)"))
    elif final and ("eval/sim_tau_chain" in final or "eval/sim_tau_tree" in final):
        out.append(sim_evaluation(final, recipe, str(run / "final_eval.json")))
    report = read_object(run / "report.json")
    found = report_evaluation(report, str(run / "report.json")) if report else None
    return tuple(out + ([found] if found else []))


def target_rows(meta: dict, layers: int | None) -> tuple[tuple[str, str], ...]:
    """What the drafter reads of the target: capture ids (EAGLE-3) and its draft vocabulary."""
    out = []
    ids = meta.get("capture_ids")
    if ids:
        default = layers is not None and sorted(ids) == engine_default_ids(layers)
        out.append(
            (
                "capture ids (HF hidden-state ids)",
                f"{list(ids)}" + (" (the engines' shared default)" if default else ""),
            )
        )
    if meta.get("draft_vocab_size"):
        out.append(("draft vocabulary", f"{meta['draft_vocab_size']:,} tokens of the target's"))
    return tuple(out)


def export_facts(
    ckpt: Path,
    meta: dict,
    fmt: str,
    layout: dict,
    target: str,
    directory: str,
    model_dir: Path | None,
    layers: int | None,
) -> CardFacts:
    """The card facts of one export: `meta` the native checkpoint's config.json, `layout` the written config."""
    recipe = meta.get("recipe") if isinstance(meta.get("recipe"), dict) else {}
    run = run_dir_of(ckpt)
    rows = read_rows(run / "metrics.jsonl") if run else []
    kind = meta["draftsmith_drafter"]
    tokens = 4  # EAGLE: the proposal length of the engines' own examples
    if kind == "medusa":  # one proposed token per head
        tokens = int(layout.get("num_heads") or (meta.get("config") or {}).get("num_heads") or 4)
    elif fmt == "speculators":  # what its config.json proposes
        tokens = int(layout["speculators_config"]["proposal_methods"][0]["speculative_tokens"])
    elif kind in ("dflash", "dspark"):  # the block less its anchor: vLLM must draft exactly these
        tokens = int((meta.get("config") or {}).get("block_size", 8)) - 1
    return CardFacts(
        fmt=fmt,
        kind=kind,
        target=target,
        directory=directory,
        license=target_license(model_dir),
        target_rows=target_rows(meta, layers),
        data=data_rows(recipe),
        training=training_rows(recipe, rows, kind),
        evaluations=run_evaluations(run, recipe),
        engine=(layout.get("draftsmith") or {}).get("engine") if fmt == "eagle3" else None,
        draft_tokens=tokens,
        vllm_only=kind == "eagle3" and (meta.get("config") or {}).get("draft_layer") == "target",
    )
