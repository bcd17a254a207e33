"""The model card (README.md) every export carries: Hugging Face metadata, then what a user of the directory
needs to trust and serve it — the target, the data, the training, the measured τ, and the commands.

Pure text from facts (`CardFacts`): gathering them from a run directory is drafters/serving/card_facts.py,
so the card of a drafter whose figures live elsewhere (the shipped one's config.json) comes from the same
function. Only facts that were recorded are shown; a missing figure is left out, never estimated.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass

import yaml

# What each format is, in a phrase, and the Hub `library_name` of the code that loads it.
LAYOUT_NAMES = {
    "native": "draftsmith's native checkpoint (config.json + model.safetensors)",
    "eagle3": "the EAGLE-3 layout of SGLang and EAGLE's releases (`LlamaForCausalLMEagle3`; `Eagle3Qwen3ForCausalLM` for a Qwen3 draft layer)",
    "speculators": "the speculators layout vLLM loads (`Eagle3Speculator`)",
    "medusa-vllm": "vLLM's Medusa layout (`MedusaModel`)",
    "vllm-dflash": "z-lab's DFlash layout, which vLLM loads as `DFlashDraftModel`",
    "speculators-dflash": "the speculators DFlash layout vLLM loads",
    "vllm-dspark": "vLLM's Qwen3 DSpark layout (`Qwen3DSparkModel`)",
}
LIBRARY = {
    "native": "draftsmith",
    "eagle3": "sglang",
    "speculators": "vllm",
    "medusa-vllm": "vllm",
    "vllm-dflash": "vllm",
    "speculators-dflash": "vllm",
    "vllm-dspark": "vllm",
}
KIND_NAMES = {
    "eagle3": "EAGLE-3",
    "eagle1": "EAGLE",
    "medusa": "Medusa",
    "layerskip": "LayerSkip",
    "dflash": "DFlash",
    "dspark": "DSpark",
}
KIND_TAGS = {k: k.replace("eagle1", "eagle") for k in KIND_NAMES}
# The engine-layout format each engine loads, per drafter kind (drafters/serving/layouts/formats.py).
ENGINE_FORMATS = {
    "eagle3": (("speculators", "vllm"), ("eagle3", "sglang")),
    "medusa": (("medusa-vllm", "vllm"),),
    "dflash": (("vllm-dflash", "vllm"),),
    "dspark": (("vllm-dspark", "vllm"),),
}
METHOD = {
    "medusa-vllm": "medusa",
    "vllm-dflash": "dflash",
    "speculators-dflash": "dflash",
    "vllm-dspark": "dspark",
}  # vLLM's method name


@dataclass(frozen=True)
class Evaluation:
    """One τ table: what was decoded, and τ (tokens per target pass, bonus token included) per draft shape."""

    title: str  # what was measured, e.g. "held-out decoding at the end of training"
    setting: str  # prompts, length, sampling, precision
    rows: tuple[tuple[str, str, str], ...]  # (draft shape, τ, speed vs AR or "")
    notes: tuple[str, ...] = ()  # acceptance by depth, held-out loss, comparison rows
    source: str = ""  # where the figures are recorded


@dataclass(frozen=True)
class CardFacts:
    """Everything a card says, as recorded; (label, value) rows keep their order."""

    fmt: str  # export format (native | eagle3 | speculators | medusa-vllm)
    kind: str  # drafter kind (eagle3 | eagle1 | medusa | layerskip)
    target: str  # the target's hub id or path
    directory: str  # the drafter directory the commands name
    license: str | None = None  # the target's licence, None when it records none
    target_rows: tuple[tuple[str, str], ...] = ()
    data: tuple[tuple[str, str], ...] = ()
    training: tuple[tuple[str, str], ...] = ()
    evaluations: tuple[Evaluation, ...] = ()
    engine: str | None = None  # `eagle3` export with explicit capture ids: the one engine that reads them right
    draft_tokens: int = 4  # num_speculative_tokens in the serve commands
    prompts: str = "PROMPTS.jsonl"  # the prompt file the evaluate command names
    vllm_only: bool = False  # a Qwen3 draft layer (`draft_layer: target`): SGLang 0.5.23 has no class for it


def front_matter(f: CardFacts) -> dict:
    """The Hub metadata block: base model, loading library, licence, tags."""
    engines = engine_tags(f)
    tags = ["speculative-decoding", KIND_TAGS.get(f.kind, f.kind), "draftsmith", *engines]
    return {
        "base_model": f.target,
        "library_name": "vllm" if f.vllm_only and f.fmt == "eagle3" else LIBRARY[f.fmt],
        "license": f.license or "unknown",
        "tags": list(dict.fromkeys(tags)),
    }


def engine_tags(f: CardFacts) -> list[str]:
    """The serving engines that load this directory as it is."""
    if f.fmt == "eagle3":
        engines = [f.engine] if f.engine else ["sglang", "vllm"]
        return [e for e in engines if e != "sglang"] if f.vllm_only else engines
    return {
        "speculators": ["vllm", "speculators"],
        "medusa-vllm": ["vllm"],
        "vllm-dflash": ["vllm"],
        "speculators-dflash": ["vllm", "speculators"],
        "vllm-dspark": ["vllm"],
    }.get(f.fmt, [])


def rows(items: tuple[tuple[str, str], ...], empty: str) -> list[str]:
    return [f"- {label}: {value}" for label, value in items] or [empty]


def tau_table(e: Evaluation) -> list[str]:
    """One evaluation as markdown: its setting, a τ table (speed column only when measured), its notes."""
    speed = any(r[2] for r in e.rows)
    head = ["| draft shape | τ |" + (" speed vs AR |" if speed else ""), "|---|---|" + ("---|" if speed else "")]
    body = [f"| {shape} | {tau} |" + (f" {vs or '–'} |" if speed else "") for shape, tau, vs in e.rows]
    src = [f"Recorded in {e.source}."] if e.source else []
    return [
        f"### {e.title}",
        "",
        e.setting,
        "",
        *head,
        *body,
        "",
        *[f"- {n}" for n in e.notes],
        *([""] if e.notes else []),
        *src,
        *([""] if src else []),
    ]


def vllm_command(f: CardFacts, directory: str, fmt: str) -> str:
    method = METHOD.get(fmt, "eagle3")
    spec = json.dumps({"method": method, "model": directory, "num_speculative_tokens": f.draft_tokens})
    return f"vllm serve {shlex.quote(f.target)} --speculative-config {shlex.quote(spec)}"


def sglang_command(f: CardFacts, directory: str) -> str:
    steps = max(1, f.draft_tokens - 1)
    return (
        f"python -m sglang.launch_server --model {shlex.quote(f.target)} --speculative-algorithm EAGLE3 "
        f"--speculative-draft-model-path {shlex.quote(directory)} --speculative-num-steps {steps} "
        f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {f.draft_tokens}"
    )


def engine_section(f: CardFacts, directory: str, fmt: str, only: str | None = None, first: str = "") -> list[str]:
    """vLLM and SGLang commands for one engine-layout directory (`only`: one engine's, after the command
    `first`), with what an engine cannot do said plainly."""
    out = []
    pre = [first] if first else []
    reads_vllm = only in (None, "vllm") and (fmt != "eagle3" or f.engine in (None, "vllm"))
    reads_sglang = only in (None, "sglang") and fmt == "eagle3" and f.engine in (None, "sglang") and not f.vllm_only
    if reads_vllm:
        out += ["vLLM:", "", "```bash", *pre, vllm_command(f, directory, fmt), "```", ""]
    if reads_sglang:
        out += ["SGLang:", "", "```bash", *pre, sglang_command(f, directory), "```", ""]
    if fmt == "vllm-dspark":
        out += ["vLLM 0.32 runs DSpark in its GPU model runner (V2) only; its CPU runner has no DSpark proposer.", ""]
    if f.vllm_only and only in (None, "sglang"):  # no other engine note applies: SGLang cannot load it at all
        again = " (export the native checkpoint again with `--engine vllm`)" if fmt == "eagle3" and f.engine else ""
        return out + [f"SGLang 0.5.23 has no EAGLE-3 drafter with a Qwen3 layer: serve it with vLLM{again}.", ""]
    if only is not None:
        return out
    if fmt == "eagle3" and f.engine:
        other = "vllm" if f.engine == "sglang" else "sglang"
        out += [
            f"Its capture ids are written in {f.engine}'s convention: {other} would capture other layers "
            f"(export the native checkpoint again with `--engine {other}`).",
            "",
        ]
    elif fmt == "speculators":
        out += ["SGLang reads the `eagle3` layout: export the native checkpoint again with `--format eagle3`.", ""]
    elif fmt == "medusa-vllm":
        out += ["SGLang has no Medusa drafter: serve it with vLLM.", ""]
    elif fmt in ("vllm-dflash", "speculators-dflash", "vllm-dspark"):
        out += [f"vLLM drafts the whole block: keep num_speculative_tokens at {f.draft_tokens} (block size - 1).", ""]
    return out


def serving(f: CardFacts) -> list[str]:
    """The serve commands: the engines for an engine layout; for a native checkpoint, an export per engine
    (speculators for vLLM, eagle3 for SGLang: right whatever the capture ids), then its command."""
    out = ["## Serving", ""]
    if f.fmt != "native":
        out += engine_section(f, f.directory, f.fmt)
    elif f.kind in ENGINE_FORMATS:
        out += ["Engines do not load the native format: export it for the engine first.", ""]
        for fmt, engine in ENGINE_FORMATS[f.kind]:
            exported = f"{f.directory.rstrip('/')}-{fmt}"
            export = (
                f"python -m drafters.export {shlex.quote(f.directory)} --format {fmt} --out {shlex.quote(exported)}"
            )
            out += engine_section(f, exported, fmt, engine, export)
        if f.kind == "medusa":
            out += ["SGLang has no Medusa drafter: serve it with vLLM.", ""]
    else:
        out += [
            f"No serving engine has a {KIND_NAMES.get(f.kind, f.kind)} layout draftsmith can write: "
            "this drafter runs in draftsmith's decoder.",
            "",
        ]
    t, d = shlex.quote(f.target), shlex.quote(f.directory)
    out += [
        "draftsmith's own decoder (τ, speed and output identity against plain decoding):",
        "",
        "```bash",
        f"python -m decode.evaluate --target {t} --drafter {d} --prompts {shlex.quote(f.prompts)} --out eval",
        f"python -m decode.generate --target {t} --drafter {d} --prompt 'Hello'",
        "```",
        "",
    ]
    return out


def model_card(f: CardFacts) -> str:
    """README.md of a drafter directory: YAML front matter (Hub metadata), then target, data, training,
    evaluation (only the evaluations recorded) and serving."""
    name = KIND_NAMES.get(f.kind, f.kind)
    meta = yaml.safe_dump(front_matter(f), sort_keys=False, allow_unicode=True).strip()
    lines = [
        "---",
        meta,
        "---",
        "",
        f"# {name} drafter for {f.target}",
        "",
        f"A speculative-decoding drafter trained with draftsmith on the frozen target `{f.target}`, in "
        f"{LAYOUT_NAMES[f.fmt]}. It proposes tokens and the target verifies them, so what is generated "
        "is the target's own output; the drafter only changes how many target passes it takes.",
        "",
        "## Target",
        "",
        f"- model: `{f.target}`",
        f"- licence: {f.license or 'not recorded with the target (see its own card)'}",
        *[f"- {label}: {value}" for label, value in f.target_rows],
        "",
        "## Data",
        "",
        *rows(f.data, "Not recorded with this drafter."),
        "",
        "## Training",
        "",
        *rows(f.training, "Not recorded with this drafter."),
        "",
        "## Evaluation",
        "",
    ]
    for e in f.evaluations:
        lines += tau_table(e)
    if not f.evaluations:
        lines += [
            "No evaluation is recorded with this drafter: measure it with `python -m decode.evaluate` (below).",
            "",
        ]
    return "\n".join(lines + serving(f)).rstrip() + "\n"
