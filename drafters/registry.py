"""Drafter SPEC strings -> drafters (DESIGN §6). The decode CLIs resolve SPECs only through here."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from decode.options import parse_kv
from decode.protocol import Drafter
from decode.target import Target

SPEC_FORMS = [
    "ar",
    "early-exit:K",
    "skip:i,j,...",
    "draft-model:DIR",
    "prompt-lookup[:ngram=3,min=1,k=10,branches=4]",
    "lookahead[:window=8,ngram=4,guesses=8]",
    "a native checkpoint directory (config.json with a draftsmith drafter kind)",
    "an exported EAGLE-3 directory (SGLang or speculators layout) or a vLLM Medusa directory",
]


def _ints(arg: str, spec: str) -> list[int]:
    try:
        return [int(x) for x in arg.split(",") if x]
    except ValueError:
        raise ValueError(f"drafter {spec!r}: expected integers after ':'") from None


def _early_exit(target: Target, arg: str, spec: str) -> Drafter:
    from drafters.sources.early_exit import early_exit

    ks = _ints(arg, spec)
    if len(ks) != 1:
        raise ValueError(f"drafter {spec!r}: expected early-exit:K")
    return early_exit(target, ks[0])


def _skip(target: Target, arg: str, spec: str) -> Drafter:
    from drafters.sources.skip import skip_layers

    return skip_layers(target, _ints(arg, spec))


def _draft_model(target: Target, arg: str, spec: str) -> Drafter:
    from drafters.sources.draft_model import draft_model

    if not arg:
        raise ValueError("drafter 'draft-model:DIR' needs a model directory")
    draft = Target.load(arg, dtype=str(target.dtype).removeprefix("torch."), device=str(target.device))
    return draft_model(target, draft, name=spec)


def _ar(target: Target, arg: str, spec: str) -> Drafter:
    from drafters.sources.ar import ARDrafter

    return ARDrafter()


def _prompt_lookup(target: Target, arg: str, spec: str) -> Drafter:
    from drafters.sources.prompt_lookup import PromptLookupDrafter

    kw = parse_kv(arg, {"ngram": 3, "min": 1, "k": 10, "branches": 4}, f"drafter {spec!r}")
    return PromptLookupDrafter(kw["ngram"], kw["min"], kw["k"], kw["branches"])


def _lookahead(target: Target, arg: str, spec: str) -> Drafter:
    from drafters.sources.lookahead import LookaheadDrafter

    kw = parse_kv(arg, {"window": 8, "ngram": 4, "guesses": 8}, f"drafter {spec!r}")
    return LookaheadDrafter(target, kw["window"], kw["ngram"], kw["guesses"])


# name -> factory(target, text after ':', whole spec). Other modules register their own forms here.
FACTORIES: dict[str, Callable[[Target, str, str], Drafter]] = {
    "ar": _ar,
    "early-exit": _early_exit,
    "skip": _skip,
    "draft-model": _draft_model,
    "prompt-lookup": _prompt_lookup,
    "lookahead": _lookahead,
}


def _native_dir(target: Target, path: Path) -> Drafter | None:
    from drafters.serving.checkpoint import load_as_drafter

    return load_as_drafter(target, path)


def _engine_dir(target: Target, path: Path) -> Drafter | None:
    from drafters.serving.engine_dirs import load_as_drafter

    return load_as_drafter(target, path)


# Checkpoint directories: loaders tried in order, each returning None when the directory is not theirs.
DIR_LOADERS: list[Callable[[Target, Path], Drafter | None]] = [_native_dir, _engine_dir]


# Target layers a drafter runs itself, read from its SPEC before the target is loaded, so a streamed
# target keeps layers [0, K) resident (decode.offload): name -> fn(text after ':', whole spec) -> K.
# Checkpoint kinds that run target layers (LayerSkip) add a DIR_RESIDENT reader (None = not theirs).
RESIDENT: dict[str, Callable[[str, str], int]] = {"early-exit": lambda arg, spec: _ints(arg, spec)[0] if arg else 0}


def _native_resident(path: Path) -> int | None:
    """A LayerSkip exit_head checkpoint drafts through the target's first draft_exit layers."""
    from drafters.serving.checkpoint import read_meta

    meta = read_meta(path)
    if meta is None or meta["draftsmith_drafter"] != "layerskip" or meta["config"].get("mode") != "exit_head":
        return None
    return int(meta["config"].get("draft_exit") or 0) or None


DIR_RESIDENT: list[Callable[[Path], int | None]] = [_native_resident]


def resident_layers(specs: list[str]) -> int:
    """How many first target layers the drafters run (max over SPECs): keep them resident when streaming."""
    ks = [0]
    for spec in specs:
        name, _, arg = spec.partition(":")
        if name in RESIDENT:
            ks.append(RESIDENT[name](arg, spec))
        elif Path(spec).is_dir():
            ks.extend(k for k in (reader(Path(spec)) for reader in DIR_RESIDENT) if k is not None)
    return max(ks)


def make_drafter(spec: str, target: Target) -> Drafter:
    """Build the drafter a SPEC string names, for this target."""
    name, _, arg = spec.partition(":")
    if name in FACTORIES:
        return FACTORIES[name](target, arg, spec)
    path = Path(spec)
    if path.is_dir():
        for loader in DIR_LOADERS:
            drafter = loader(target, path)
            if drafter is not None:
                return drafter
        raise ValueError(f"{spec}: a directory, but not a drafter checkpoint this version can load")
    forms = "\n  ".join(SPEC_FORMS)
    raise ValueError(f"unknown drafter SPEC {spec!r}; valid forms:\n  {forms}")
