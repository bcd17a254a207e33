"""The `draftsmith` console script: one entry point that runs the module CLIs (DESIGN §6).

    draftsmith train RECIPE.yaml [key=value ...]   = python -m train ...
    draftsmith export ...                          = python -m drafters.export ...
    draftsmith evaluate ...                        = python -m decode.evaluate ...
    draftsmith generate ...                        = python -m decode.generate ...
    draftsmith features RECIPE.yaml                = python -m train.features ...
    draftsmith doctor DRAFTER_DIR --target MODEL   = python -m drafters.doctor ...
    draftsmith fetch smollm2-135m-instruct|sharegpt = python -m train.fetch ...
    draftsmith engine-check DRAFTER_DIR --target MODEL --prompts FILE --out DIR = python -m drafters.serving.engine_check ...
    draftsmith data ls | rm KEY ... | rm --older-than DAYS = python -m train.data.home ...

Each subcommand calls its module's `main(argv)` (or runs it as `python -m` would, for a package's
__main__), so the two spellings can never drift apart.
"""

from __future__ import annotations

import importlib.util
import runpy
import sys

from decode.errors import run_cli

COMMANDS = {
    "train": "train",
    "export": "drafters.export",
    "evaluate": "decode.evaluate",
    "generate": "decode.generate",
    "features": "train.features",
    "doctor": "drafters.doctor",
    "fetch": "train.fetch",
    "engine-check": "drafters.serving.engine_check",
    "data": "train.data.home",
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {c:<{width}}  python -m {m}" for c, m in COMMANDS.items())
    return (
        f"usage: draftsmith <command> [args ...]\n\ncommands:\n{rows}\n\n`draftsmith <command> --help` for its options."
    )


def find_module(module: str):
    """The spec `python -m module` would run (a module, or a package's __main__), or None."""
    try:
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.submodule_search_locations is not None:  # a package: needs __main__
            spec = importlib.util.find_spec(f"{module}.__main__")
    except ModuleNotFoundError:  # a missing parent package
        return None
    return spec


def run_module(module: str, prog: str, argv: list[str]) -> int:
    """`main(argv)` of a plain module when it has one, else run it as `python -m` would (runpy)."""
    try:
        if not module.endswith("__main__"):
            mod = importlib.import_module(module)
            if callable(getattr(mod, "main", None)):
                return int(run_cli(mod.main, argv) or 0)  # a user error: one `error:` line, exit 2
        sys.argv = [prog, *argv]  # what the module's argparse reads, as under `python -m`
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:  # argparse errors and --help, or a module ending with sys.exit(main())
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"draftsmith: unknown command {cmd!r}\n\n{usage()}", file=sys.stderr)
        return 2
    spec = find_module(COMMANDS[cmd])
    if spec is None:
        print(
            f"draftsmith {cmd}: not yet available (module {COMMANDS[cmd]} is not part of this version)", file=sys.stderr
        )
        return 1
    return run_module(spec.name, f"draftsmith {cmd}", rest)


if __name__ == "__main__":
    sys.exit(main())
