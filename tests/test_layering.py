"""One-way layering, read from the source with `ast`: decode <- drafters <- train (DESIGN §2).

Every import counts — module level, inside functions, and under `if TYPE_CHECKING:` — because a type
a module names is a dependency all the same, and an import moved into a function to dodge a cycle
is still that cycle. The rules:
  1. `train` is imported by nobody in decode/ or drafters/;
  2. decode's modules import no drafter, except its CLI front ends, which resolve SPEC strings through
     `drafters.registry` only, and only inside functions (so importing decode.generate for its loop
     loads no drafter);
  3. no package's import graph has a cycle (the failure names one);
  4. drafters/ in its three parts: a draft source (drafters/sources/) imports no trainable drafter and nothing
     of the serving side; a trainable drafter (drafters/trainable/) may build on the sources (LayerSkip drafts
     as an early exit) but imports nothing of the serving side; the serving side (drafters/serving/) may
     import them all. drafters/common.py, the machinery sources and trainable drafters share, imports no
     part; drafters/registry.py (SPEC strings) may import every part. Every other drafters module lives in
     a part (the thin `python -m drafters.export|doctor` entry points excepted).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("decode", "drafters", "train")
# The decode command lines (and the evaluate CLI's HF-peer SPECs): the only decode files that may
# reach a drafter, and only through the registry.
FRONT_ENDS = {"decode.cli", "decode.harness.evaluate", "decode.generate", "decode.harness.hf_peers"}
REGISTRY = "drafters.registry"
# drafters' parts and the parts each may import (itself included); a part not listed may import every part.
MAY_IMPORT = {
    "drafters.sources": {"drafters.common", "drafters.sources"},
    "drafters.trainable": {"drafters.common", "drafters.sources", "drafters.trainable"},
    "drafters.common": {"drafters.common"},
}
# The drafters modules outside the three parts: the package, the shared machinery, the SPEC registry and
# the documented `python -m drafters.export|doctor` entry points (each one line into drafters/serving/).
TOP_LEVEL = {"drafters", "drafters.common", "drafters.registry", "drafters.export", "drafters.doctor"}
PARTS = ("drafters.sources", "drafters.trainable", "drafters.serving")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))}


def imports(path: Path, known: set[str]) -> list[tuple[str, int, bool]]:
    me = module_name(path)
    return parse_imports(path.read_text(), me, me if path.name == "__init__.py" else me.rpartition(".")[0], known)


def parse_imports(source: str, me: str, package: str, known: set[str]) -> list[tuple[str, int, bool]]:
    """(imported project module, line, inside a function) for every import in module `me`, at any depth."""
    tree = ast.parse(source, me)
    found: list[tuple[str, int, bool]] = []

    def resolve(name: str) -> str | None:  # the longest known module `name` is or lies in
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from .x import y
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` imports mod
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            names = []
        for target in dict.fromkeys(resolve(n) for n in names):  # one entry per module per statement
            if target is not None and target != me:
                found.append((target, node.lineno, in_function))
        inside = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inside)

    visit(tree, False)
    return found


def import_graph() -> dict[str, list[tuple[str, int, bool]]]:
    mods = project_modules()
    return {m: imports(p, set(mods)) for m, p in mods.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle [a, b, ..., a] of a directed graph, or None (iterative DFS, white/grey/black)."""
    state: dict[str, int] = {}
    for root in sorted(edges):
        if state.get(root):
            continue
        stack, path = [(root, iter(sorted(edges[root])))], [root]
        state[root] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                stack.append((nxt, iter(sorted(edges.get(nxt, ())))))
                path.append(nxt)
    return None


def test_decode_imports_no_training_and_no_drafter_outside_its_front_ends():
    bad = []
    for mod, found in import_graph().items():
        if mod.split(".")[0] != "decode":
            continue
        for target, line, in_function in found:
            pkg = target.split(".")[0]
            if pkg == "train":
                bad.append(f"{mod}:{line} imports {target} (decode knows nothing of training)")
            elif pkg == "drafters" and mod not in FRONT_ENDS:
                bad.append(f"{mod}:{line} imports {target} (decode's core knows no drafter, only decode.protocol)")
            elif pkg == "drafters" and (target != REGISTRY or not in_function):
                bad.append(
                    f"{mod}:{line} imports {target} (front ends reach drafters only through "
                    f"{REGISTRY}, inside the CLI functions)"
                )
    assert not bad, "\n".join(bad)


def test_drafters_import_nothing_from_train():
    bad = [
        f"{mod}:{line} imports {target}"
        for mod, found in import_graph().items()
        if mod.split(".")[0] == "drafters"
        for target, line, _ in found
        if target.split(".")[0] == "train"
    ]
    assert not bad, "drafters must not import train (a drafter's objective lives with the drafter):\n" + "\n".join(bad)


def part_of(module: str) -> str:
    """drafters.sources.ar -> drafters.sources; drafters.common -> drafters.common."""
    return ".".join(module.split(".")[:2])


def part_violations(graph: dict[str, list[tuple[str, int, bool]]]) -> list[str]:
    """Imports between drafters' parts that MAY_IMPORT does not allow, and drafters modules in no part."""
    bad = []
    for mod, found in graph.items():
        if mod.split(".")[0] != "drafters":
            continue
        if mod not in TOP_LEVEL and part_of(mod) not in PARTS:
            bad.append(f"{mod} lives in no part of drafters/ (put it in {', '.join(PARTS)})")
        allowed = MAY_IMPORT.get(part_of(mod))
        for target, line, _ in found:
            if allowed is not None and target.split(".")[0] == "drafters" and part_of(target) not in allowed:
                bad.append(f"{mod}:{line} imports {target} ({part_of(mod)} may import only {sorted(allowed)})")
    return bad


def test_drafters_parts_import_one_way():
    bad = part_violations(import_graph())
    assert not bad, "drafters/ parts: sources <- trainable <- serving:\n" + "\n".join(bad)


def test_no_import_cycles():
    graph = import_graph()
    for pkg in PACKAGES:
        edges = {
            m: {t for t, _, _ in found if t.split(".")[0] == pkg}
            for m, found in graph.items()
            if m.split(".")[0] == pkg
        }
        cycle = find_cycle(edges)
        assert cycle is None, (
            f"import cycle in {pkg}/: {' -> '.join(cycle)} (function-level and TYPE_CHECKING imports count)"
        )


def test_the_checker_sees_every_kind_of_import():
    """The walker finds function-level, TYPE_CHECKING and `from pkg import module` imports, and cycles."""
    src = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from train.config import Recipe\n"
        "def f():\n    from train import loop\n    import drafters.trainable.eagle\n"
    )
    got = parse_imports(src, "train.probe", "train", set(project_modules()))
    assert got == [("train.config", 3, False), ("train.loop", 5, True), ("drafters.trainable.eagle", 6, True)]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    probe = {
        "drafters.sources.x": [("drafters.serving.export", 3, True), ("drafters.common", 4, False)],
        "drafters.trainable.y": [("drafters.sources.x", 5, False), ("drafters.registry", 6, True)],
        "drafters.serving.z": [("drafters.trainable.y", 7, False)],
        "drafters.stray": [],
    }
    assert part_violations(probe) == [
        "drafters.sources.x:3 imports drafters.serving.export (drafters.sources may import only "
        "['drafters.common', 'drafters.sources'])",
        "drafters.trainable.y:6 imports drafters.registry (drafters.trainable may import only "
        "['drafters.common', 'drafters.sources', 'drafters.trainable'])",
        "drafters.stray lives in no part of drafters/ (put it in drafters.sources, drafters.trainable, drafters.serving)",
    ]
