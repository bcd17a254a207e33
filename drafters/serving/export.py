"""`python -m drafters.export RUN_OR_CKPT_DIR --format native|eagle3|speculators|medusa-vllm|vllm-dflash|... --out DIR`.

1. find the native checkpoint (a run directory means RUN_DIR/export) and read its config.json;
2. read the target's config (--target, else the one the checkpoint names) and check the checkpoint was trained
   for it and holds exactly the drafter's keys and shapes (of the target's weights only what a layout copies);
3. plan the layout (drafters/serving/layouts/): config.json and the source of every exported key; gather the
   tensors and check them against the engine's expectations (exact key set, shapes, required config
   fields, the target's sizes, max positions, rope and capture ids) before anything is written;
4. write atomically (temp dir + rename), with the target's tokenizer files (for `draftsmith doctor`'s tokenizer
   check) and a model card (README.md: Hub metadata, target, data, training, τ, serve commands; model_card.py).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from decode.errors import UserError, check_out_dir, one_line, writing
from drafters.serving.card_facts import export_facts
from drafters.serving.checkpoint import (
    ADAPTER_DIR,
    config_fingerprint,
    fingerprint_mismatch,
    native_shapes,
    read_meta,
    skeleton_target,
    write_atomically,
)
from drafters.serving.layouts import vllm_dflash, vllm_dspark
from drafters.serving.layouts.formats import (
    BLOCK_LAYOUTS,
    FORMATS,
    LAYER_PREFIX,
    check_export,
    check_fits,
    plan,
    planned_shapes,
)
from drafters.serving.layouts.rules import (
    DRAFT_HEAD,
    EMBEDDING_NOTE,
    ENGINES,
    SHARED_EMBEDDING,
    TARGET_EMBED,
    TARGET_HEAD,
    TargetFacts,
    ascending_fc,
    key_problems,
)
from drafters.serving.model_card import model_card

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)


def find_checkpoint(path: str | Path) -> Path:
    """The native checkpoint a path names: itself, or RUN_DIR/export for a run directory."""
    p = Path(path)
    if read_meta(p) is not None:
        return p
    if read_meta(p / "export") is not None:
        return p / "export"
    if (p / "checkpoints").is_dir():
        raise FileNotFoundError(
            f"{p} is a run directory without a finished export ({p / 'export'}): "
            "finish the run first (rerun the recipe with resume=auto)"
        )
    raise FileNotFoundError(
        f"{p} is neither a native draftsmith checkpoint (config.json with 'draftsmith_drafter') "
        "nor a run directory with export/"
    )


def local_model_dir(name_or_path: str) -> Path | None:
    """The directory holding a model's files: a local path, or a hub id's cached snapshot (None if neither)."""
    p = Path(name_or_path)
    if p.is_dir():
        return p
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name_or_path, local_files_only=True))
    except Exception:  # not a hub id, or not cached: the caller says what it needed
        return None


def target_config(name_or_path: str):
    """The target's PretrainedConfig (config.json only; no weights are read)."""
    from transformers import AutoConfig

    from decode.loading import resolve_model_path

    try:
        return AutoConfig.from_pretrained(resolve_model_path(name_or_path), trust_remote_code=False)
    except (OSError, ValueError) as e:
        msg = f"cannot read the target's config {name_or_path!r}: {e}\npass --target MODEL_DIR (the drafter's target)"
        raise FileNotFoundError(msg) from e


def file_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """{key: shape} of a safetensors file, read from its header (no tensor is loaded)."""
    try:
        with safe_open(str(path), "pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except SafetensorError as e:
        raise UserError(
            f"{path}: not a readable safetensors file ({one_line(e)}); the file is damaged (an "
            "interrupted copy?): copy or export it again"
        ) from None


def target_head(model_dir: Path | None, config) -> torch.Tensor:
    """The target's LM head [V, H] read from its safetensors (the embedding when the head is tied)."""
    tied = bool(getattr(config, "tie_word_embeddings", False))
    names = ["model.embed_tokens.weight", "lm_head.weight"] if tied else ["lm_head.weight"]
    why = "the export copies the target's LM head (Medusa; a draft vocabulary's rows; DSpark's heads)"
    return target_tensor(model_dir, names, why)


def target_tensor(model_dir: Path | None, names: list[str], why: str) -> torch.Tensor:
    """The first of `names` found in the target's safetensors files (one file or an indexed set)."""
    if model_dir is None:
        raise FileNotFoundError(f"{why}: pass --target MODEL_DIR with its weights")
    index = model_dir / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"] if index.is_file() else {}
    for name in names:
        file = model_dir / weight_map.get(name, "model.safetensors")
        if file.is_file():
            with safe_open(str(file), "pt") as f:
                if name in f.keys():
                    return f.get_tensor(name)
    raise FileNotFoundError(f"{model_dir}: no {names[0]} in the target's safetensors files ({why})")


def export(
    src: str | Path,
    fmt: str,
    out: str | Path,
    target: str | None = None,
    dtype: str = "keep",
    speculative_tokens: int = 0,
    shared_head_once: bool = False,
    engine: str = "sglang",
    with_embeddings: bool = False,
) -> Path:
    """Export a native checkpoint (or RUN_DIR) to `fmt` in `out`; returns the written directory. engine: who
    reads an `eagle3` export's non-default capture ids (formats.plan); with_embeddings: EAGLE-3 layouts also
    carry the target's embedding (rules.EMBEDDING_NOTE)."""
    # 1. the checkpoint
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r} not one of {sorted(FORMATS)}")
    if dtype != "keep" and dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} not one of keep, {', '.join(DTYPES)}")
    check_out_dir(out)  # before reading anything: an unwritable --out fails at once
    ckpt = find_checkpoint(src)
    meta = read_meta(ckpt)
    kind = meta["draftsmith_drafter"]
    check_fits(fmt, kind)
    # 2. the target (config only) and the checkpoint's own keys
    name = target or meta["target"].get("name_or_path")
    if not name:
        raise ValueError(f"{ckpt} does not name its target: pass --target MODEL_DIR")
    config = target_config(name)
    trained_for = fingerprint_mismatch(meta["target"]["fingerprint"], config_fingerprint(config.to_dict()))
    if trained_for:
        raise ValueError(f"{ckpt} was trained for another target than {name}:\n  " + "\n  ".join(trained_for))
    weights = ckpt / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"{ckpt}: model.safetensors is missing")
    wrong = key_problems(file_shapes(weights), native_shapes(meta, skeleton_target(config)), str(weights))
    if wrong:
        raise ValueError(
            f"{weights} does not hold a {kind} drafter of its config.json:\n  " + "\n  ".join(map(str, wrong))
        )
    if fmt == "native":
        card = export_card(ckpt, meta, fmt, meta, name, out, config)

        def write_native(tmp: Path) -> None:
            copy_native(ckpt, tmp, DTYPES.get(dtype))
            (tmp / "README.md").write_text(card, encoding="utf-8")

        with writing(out):
            return write_atomically(out, write_native)

    # 3. plan, gather, check
    facts = TargetFacts.of(config.to_dict(), name)
    state = load_file(str(weights))
    if with_embeddings and fmt not in LAYER_PREFIX:
        raise ValueError(f"--with-embeddings is for the EAGLE-3 layouts (eagle3, speculators), not {fmt}")
    layout, sources = plan(fmt, meta, list(state), facts, speculative_tokens, shared_head_once, engine, with_embeddings)
    extra = frozenset({SHARED_EMBEDDING} if with_embeddings else ())
    check_export(
        fmt, layout, planned_shapes(sources, {k: tuple(v.shape) for k, v in state.items()}, facts), facts, extra
    )
    if fmt in LAYER_PREFIX or fmt in BLOCK_LAYOUTS:
        state = {**state, "fc.weight": ascending_fc(state["fc.weight"], [int(i) for i in meta["capture_ids"]])}
    need_head = {TARGET_HEAD, DRAFT_HEAD} & set(sources.values()) or fmt == "vllm-dspark"  # its heads read the head
    head = target_head(local_model_dir(name), config) if need_head else None
    rows = head[torch.arange(len(state["d2t"])) + state["d2t"]] if DRAFT_HEAD in sources.values() else None
    embed = (
        target_tensor(local_model_dir(name), ["model.embed_tokens.weight"], "the export copies the target's embedding")
        if {TARGET_EMBED, vllm_dflash.MASK_ROWS} & set(sources.values())
        else None
    )
    if vllm_dflash.MASK_ROWS in sources.values():  # a learned mask: one row after the target's vocabulary
        embed = torch.cat([embed, state["mask_embedding"][None].to(embed.dtype)])
    cast = DTYPES.get(dtype, next(v.dtype for v in state.values() if v.is_floating_point()))  # keep: the drafter's
    derived = {TARGET_HEAD: head, TARGET_EMBED: embed, vllm_dflash.MASK_ROWS: embed, DRAFT_HEAD: rows}
    if fmt == "vllm-dspark":
        derived |= vllm_dspark.heads(state, rows if rows is not None else head)
    tensors = {}
    for key, source in sources.items():
        t = derived.get(source)
        t = t.clone() if t is not None else state[source]  # clones: safetensors refuses shared storage
        tensors[key] = (t.to(cast) if t.is_floating_point() else t).contiguous()
    layout["torch_dtype"] = str(cast).removeprefix("torch.")
    check_export(fmt, layout, {k: tuple(v.shape) for k, v in tensors.items()}, facts, extra)  # what is written

    # 4. write
    tok_dir = local_model_dir(name)
    card = export_card(ckpt, meta, fmt, layout, name, out, config)

    def write(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(layout, indent=2) + "\n")
        (tmp / "README.md").write_text(card, encoding="utf-8")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for f in TOKENIZER_FILES:
            if tok_dir is not None and (tok_dir / f).is_file():
                shutil.copy2(tok_dir / f, tmp / f)

    with writing(out):
        return write_atomically(out, write)


def export_card(ckpt: Path, meta: dict, fmt: str, layout: dict, target: str, out: str | Path, config) -> str:
    """README.md of the export (drafters/serving/model_card.py), built before anything is written so that the
    card lands in the same atomic rename as the weights it describes."""
    facts = export_facts(
        ckpt, meta, fmt, layout, target, str(out), local_model_dir(target), getattr(config, "num_hidden_layers", None)
    )
    return model_card(facts)


def copy_native(ckpt: Path, tmp: Path, cast: torch.dtype | None = None) -> None:
    """The checkpoint's files; cast: its floating tensors saved in that dtype (a bf16 copy to ship; loading
    casts them back to the module's dtype, and the target verifies whatever the drafter proposes)."""
    shutil.copy2(ckpt / "config.json", tmp / "config.json")
    if cast is None:
        shutil.copy2(ckpt / "model.safetensors", tmp / "model.safetensors")
    else:
        state = load_file(str(ckpt / "model.safetensors"))
        state = {k: (v.to(cast) if v.is_floating_point() else v).contiguous() for k, v in state.items()}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    if (ckpt / ADAPTER_DIR).is_dir():
        shutil.copytree(ckpt / ADAPTER_DIR, tmp / ADAPTER_DIR)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m drafters.export", description=__doc__.splitlines()[0])
    ap.add_argument("src", help="native checkpoint directory, or a run directory (its export/)")
    ap.add_argument(
        "--format",
        required=True,
        choices=sorted(FORMATS),
        help="native | eagle3 (SGLang/EAGLE release layout) | speculators (vLLM) | medusa-vllm | vllm-dflash "
        "(vLLM DFlashDraftModel) | speculators-dflash",
    )
    ap.add_argument("--out", required=True, help="output directory (replaced atomically)")
    ap.add_argument("--target", help="target model dir or hub id (default: the one the checkpoint names)")
    ap.add_argument("--dtype", default="keep", help="keep | float32 | bfloat16 | float16 (native too)")
    ap.add_argument(
        "--speculative-tokens",
        type=int,
        default=0,
        help="speculators: proposal length written to the config (default: the training-time-test depth); "
        "DFlash layouts take only block_size - 1",
    )
    ap.add_argument(
        "--medusa-shared-head",
        action="store_true",
        help="medusa-vllm with the target's head: write it once (vLLM original_lm_head) instead of a copy per head",
    )
    ap.add_argument(
        "--engine",
        choices=ENGINES,
        default="sglang",
        help="eagle3 with non-default capture ids: the engine that reads them (SGLang: HF id - 1, "
        "vLLM: HF ids); default ids are left out and both engines read them right",
    )
    ap.add_argument(
        "--with-embeddings",
        action="store_true",
        help="eagle3/speculators: also write the target's embedding (embed_tokens.weight, vocab x hidden: "
        "~1.5 GiB bf16 for Qwen3-14B); speculators 0.9.0 needs it to load reliably, engines ignore it",
    )
    args = ap.parse_args(argv)
    try:
        out = export(
            args.src,
            args.format,
            args.out,
            args.target,
            args.dtype,
            args.speculative_tokens,
            args.medusa_shared_head,
            args.engine,
            args.with_embeddings,
        )
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg = json.loads((out / "config.json").read_text())
    shapes = file_shapes(out / "model.safetensors")
    params = sum(int(torch.Size(s).numel()) for s in shapes.values())
    print(f"wrote {args.format} export to {out}: {len(shapes)} tensors, {params / 1e6:.1f}M values")
    ids = (cfg.get("draftsmith") or {}).get("capture_ids_hf")
    if args.format == "eagle3" and ids:
        print(f"capture ids: HF hidden-state ids {ids}; {cfg['draftsmith']['note']}")
        if cfg["draftsmith"].get("engine"):
            other = "vllm" if args.engine == "sglang" else "sglang"
            print(
                f"warning: this directory is for {args.engine}: {other} would capture other layers "
                f"(re-export with --engine {other}{' or --format speculators' if other == 'vllm' else ''})",
                file=sys.stderr,
            )
    if args.format in LAYER_PREFIX and not args.with_embeddings:
        print(f"note: no embed_tokens.weight ({EMBEDDING_NOTE}); add --with-embeddings to load it with speculators")
    if args.format in ("medusa-vllm", "vllm-dflash") and cfg.get("draftsmith", {}).get("note"):
        print(f"note: {cfg['draftsmith']['note']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
