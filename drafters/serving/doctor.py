"""`draftsmith doctor DRAFTER_DIR --target MODEL` (= python -m drafters.doctor): does a drafter fit a target?

Checks a native checkpoint or an engine-layout directory (EAGLE-3 in SGLang's or the speculators layout,
vLLM Medusa) against the target's config and tokenizer: hidden size, vocabulary and tokenizer identity,
capture ids in range, max positions, rope settings, head dims and kv heads, and the exact tensors the
drafter's config implies. Each problem is printed with its fix. Reads configs, tokenizers and
safetensors headers only (never weights), so a 14B setup is checked in seconds.
Exit status: 0 no problems, 1 problems, 2 the input could not be read.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

from drafters.serving.checkpoint import (
    ADAPTER_DIR,
    config_fingerprint,
    fingerprint_mismatch,
    native_shapes,
    skeleton_target,
)
from drafters.serving.engine_dirs import read_config, weight_files
from drafters.serving.export import TOKENIZER_FILES, file_shapes, target_config
from drafters.serving.layouts.formats import BLOCK_LAYOUTS, LAYER_PREFIX, detect_format, problems
from drafters.serving.layouts.rules import (
    EMBEDDING_NOTE,
    SHARED_EMBEDDING,
    Problem,
    TargetFacts,
    capture_ids_hf,
    eagle3_engine,
    engine_ids,
    key_problems,
    recorded_capture_ids,
    tokenizer_digest,
    unnamed_ids_warning,
)


@dataclass
class Report:
    """What the doctor found about one drafter directory."""

    fmt: str
    summary: str
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def load_target_tokenizer(name_or_path: str):
    """The target's tokenizer, or None when it has none (no tokenizer files) or it cannot be read."""
    from decode.loading import load_tokenizer

    p = Path(name_or_path)
    if p.is_dir() and not any((p / f).is_file() for f in TOKENIZER_FILES):
        return None
    try:
        return load_tokenizer(name_or_path)
    except (OSError, ValueError):
        return None


def tokenizer_problem(drafter_digest: str | None, target_tok, where: str) -> list[Problem]:
    target_digest = tokenizer_digest(target_tok)
    if drafter_digest is None or target_digest is None or drafter_digest == target_digest:
        return []
    return [
        Problem(
            f"tokenizer: {where} differs from the target's (vocabulary or special ids)",
            "token ids would mean other tokens: use the target whose tokenizer the drafter was trained with",
        )
    ]


def native_report(path: Path, meta: dict, config, facts: TargetFacts, target_tok) -> Report:
    """A native checkpoint: the target fingerprint it recorded, its ids, its tensors, its tokenizer."""
    kind, trained_for = meta["draftsmith_drafter"], meta["target"].get("name_or_path")
    rep = Report("native", f"native {kind} drafter, trained for {trained_for}")
    saved = meta["target"]["fingerprint"]
    fix = f"use the target it was trained for ({trained_for}), or retrain for this one"
    for line in fingerprint_mismatch(saved, config_fingerprint(config.to_dict())):
        rep.problems.append(Problem(line, fix))
    ids = meta.get("capture_ids") or []
    bad = [i for i in ids if not 0 <= i < facts.layers]
    if bad:
        rep.problems.append(
            Problem(
                f"capture ids {bad} out of range 0..{facts.layers - 1} for a {facts.layers}-layer "
                "target (HF hidden-state ids)",
                fix,
            )
        )
    if ids:
        rep.summary += f"; capture ids (HF) {ids}, draft vocab {meta.get('draft_vocab_size')} of {facts.vocab}"
    rep.problems += tokenizer_problem(meta["target"].get("tokenizer"), target_tok, "the tokenizer it was trained with")
    weights = path / "model.safetensors"
    if not weights.is_file():
        rep.problems.append(Problem(f"{weights} is missing", "re-save or re-export the checkpoint"))
    elif not rep.problems:  # the expected tensors are only defined on the right target
        try:
            expected = native_shapes(meta, skeleton_target(config))
        except (ValueError, TypeError) as e:
            rep.problems.append(Problem(f"config.json: {e}", "the drafter's config does not build on this target"))
        else:
            rep.problems += key_problems(file_shapes(weights), expected, str(weights))
    if meta["config"].get("mode") == "lora" and not (path / ADAPTER_DIR / "adapter_model.safetensors").is_file():
        rep.problems.append(
            Problem(
                f"LoRA drafter without {ADAPTER_DIR}/adapter_model.safetensors",
                "re-save the checkpoint: the LoRA weights live in its peft adapter directory",
            )
        )
    return rep


def engine_report(path: Path, fmt: str, cfg: dict, facts: TargetFacts, target_tok) -> Report:
    """An EAGLE-3 (SGLang / speculators) or vLLM Medusa directory: its config and tensors vs the engine and target."""
    rep = Report(fmt, f"{fmt} layout")
    try:
        shapes = {k: v for f in weight_files(path) for k, v in file_shapes(f).items()}
    except (ValueError, FileNotFoundError) as e:
        rep.problems.append(Problem(str(e), "provide the weights as model.safetensors"))
        shapes = None
    found = problems(fmt, cfg, shapes or {}, facts, frozenset({SHARED_EMBEDDING} if fmt in LAYER_PREFIX else ()))
    rep.problems += [p for p in found if shapes is not None or not p.what.startswith("model.safetensors")]
    if fmt in LAYER_PREFIX:
        ids, explicit = capture_ids_hf(fmt, cfg, facts.layers)
        engine = "vLLM" if fmt == "speculators" or eagle3_engine(cfg) == "vllm" else "SGLang"
        rep.summary += (
            f"; capture ids (HF) {ids} = {engine} {engine_ids(fmt, cfg, ids)}"
            f"{'' if explicit else ' (engine default)'}; draft vocab {cfg.get('draft_vocab_size')} "
            f"of {facts.vocab}"
        )
        unnamed = unnamed_ids_warning(cfg, ids, explicit)  # none for our own exports of the default ids
        if unnamed and recorded_capture_ids(cfg) is None:
            rep.notes.append(
                f"the config names no capture ids: engines (and draftsmith) use the default HF ids {ids}; "
                "if the drafter was trained on other layers, write them into the config"
            )
        elif unnamed:
            rep.notes.append(unnamed)
        elif fmt == "eagle3" and eagle3_engine(cfg):
            rep.notes.append(
                f"written for {eagle3_engine(cfg)} only (explicit capture ids that SGLang and vLLM read "
                "differently); the other engine needs its own export (--engine)"
            )
        if fmt == "speculators" and shapes is not None and SHARED_EMBEDDING not in shapes:
            rep.notes.append(
                f"warning: no {SHARED_EMBEDDING}: {EMBEDDING_NOTE}; fix: re-export with "
                "--with-embeddings to load it with speculators"
            )
        layer = cfg if fmt == "eagle3" else cfg.get("transformer_layer_config") or {}
        eps = layer.get("rms_norm_eps")
        if eps is not None and float(eps) != facts.eps:
            rep.notes.append(f"rms_norm_eps {eps} differs from the target's {facts.eps} (the drafter keeps its own)")
    if shapes and SHARED_EMBEDDING in shapes and fmt in BLOCK_LAYOUTS:  # the learned mask's row (vllm_dflash.py)
        rep.notes.append(
            f"{SHARED_EMBEDDING}: the target's embedding + the learned mask row vLLM embeds masked rows with"
        )
    elif shapes and SHARED_EMBEDDING in shapes:
        rep.notes.append(
            f"{SHARED_EMBEDDING} is in the file: engines (and draftsmith) use the target's embedding "
            "instead (speculators loads it)"
        )
    if any((path / f).is_file() for f in TOKENIZER_FILES):
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
        except (OSError, ValueError) as e:
            rep.notes.append(f"could not read the tokenizer files in {path}: {e}")
        else:
            rep.problems += tokenizer_problem(
                tokenizer_digest(tok), target_tok, "the tokenizer shipped with the drafter"
            )
    return rep


def diagnose(drafter_dir: str | Path, target: str) -> Report:
    """Every problem of the drafter in `drafter_dir` on the target `target` (a model dir or hub id)."""
    path = Path(drafter_dir)
    cfg = read_config(path)
    if cfg is None:
        raise FileNotFoundError(f"{path}: no config.json (not a drafter directory)")
    fmt = detect_format(cfg)
    if fmt is None:
        raise ValueError(
            f"{path}/config.json is in no layout draftsmith knows (a native checkpoint, "
            "LlamaForCausalLMEagle3, Eagle3Qwen3ForCausalLM, Eagle3Speculator or MedusaModel)"
        )
    config = target_config(target)
    facts = TargetFacts.of(config.to_dict(), target)
    tok = load_target_tokenizer(target)
    if fmt == "native":
        return native_report(path, cfg, config, facts, tok)
    return engine_report(path, fmt, cfg, facts, tok)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="draftsmith doctor", description=__doc__.splitlines()[0])
    ap.add_argument("drafter", help="drafter directory: native checkpoint, EAGLE-3 (SGLang/speculators) or vLLM Medusa")
    ap.add_argument("--target", required=True, help="target model directory or hub id (config and tokenizer are read)")
    args = ap.parse_args(argv)
    try:
        rep = diagnose(args.drafter, args.target)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.drafter}: {rep.summary}")
    for i, p in enumerate(rep.problems, 1):
        print(f"problem {i}: {p}")
    for note in rep.notes:
        print(f"note: {note}")
    if rep.problems:
        print(f"{len(rep.problems)} problem(s) with target {args.target}")
        return 1
    print(f"OK: fits target {args.target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
