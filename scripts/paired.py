"""Paired τ differences between the rows of one evaluation report, over the same prompts.

    python scripts/paired.py runs/bench80/report.json --pair NEW_ROW OLD_ROW [--pair ...]

A row is named by a substring of its spec (or its name) that matches exactly one row of the report, e.g.
`e3-new/export@dynamic` or `drafters/eagle3`. For each pair it prints both rows' τ, tokens/s and speed against
AR, and the mean per-prompt τ difference NEW - OLD with its standard error: the same prompts decoded by two
drafters differ less than two independent samples, so the paired SE is the spread to read a change against.
Nothing here loads a model; the report is decode.evaluate's (or scripts/bench_chat.py's) report.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# run as `python scripts/paired.py`, sys.path starts at scripts/ itself: the checkout makes scripts.* importable
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts.curve_points import paired_delta  # noqa: E402


def find_row(rows: list[dict], key: str) -> dict:
    """The one row whose spec or name equals `key`, else ends with it, else contains it (the first unique match)."""
    for tier in (str.__eq__, str.endswith, str.__contains__):
        hits = [r for r in rows if any(tier(str(r.get(f, "")), key) for f in ("spec", "name"))]
        if len(hits) == 1:
            return hits[0]
    names = ", ".join(str(r.get("spec") or r.get("name")) for r in (hits or rows))
    raise SystemExit(f"error: '{key}' matches {len(hits)} rows, need exactly one; rows: {names}")


def per_prompt_tau(row: dict) -> dict[str, float]:
    """{prompt id (and turn): τ} of one row, from its per-prompt records."""
    out = {}
    for p in row.get("prompts") or []:
        out[f"{p['id']}/{p.get('turn', 0)}"] = float(p["mean_accepted_tokens"])
    return out


def pair_line(new: dict, old: dict) -> str:
    """One line: both rows' τ and speed, and the paired Δ τ ± SE over the prompts both decoded."""
    a, b = per_prompt_tau(new), per_prompt_tau(old)
    ids = sorted(set(a) & set(b))
    if not ids:
        raise SystemExit(f"error: rows '{new['spec']}' and '{old['spec']}' share no prompt records")
    mean, se = paired_delta([a[i] for i in ids], [b[i] for i in ids])

    def cell(r: dict) -> str:
        return f"τ {r['mean_accepted_tokens']:.3f}, {r['tokens_per_s']:.1f} tok/s, {r.get('speedup_vs_ar', 0):.2f}x AR"

    return f"{new['spec']}  [{cell(new)}]\n  vs {old['spec']}  [{cell(old)}]\n  Δ τ {mean:+.3f} ± {se:.3f} ({len(ids)} prompts)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("report", type=Path, help="a report.json of decode.evaluate or scripts/bench_chat.py")
    ap.add_argument(
        "--pair",
        nargs=2,
        action="append",
        required=True,
        metavar=("NEW", "OLD"),
        help="two rows, each named by a substring",
    )
    args = ap.parse_args()
    if not args.report.is_file():
        sys.exit(f"error: no report at {args.report} (pass the report.json an evaluation wrote)")
    rows = json.loads(args.report.read_text())["drafters"]
    for new_key, old_key in args.pair:  # a tree spec holds '=', so the two rows are two arguments
        print(pair_line(find_row(rows, new_key), find_row(rows, old_key)))


if __name__ == "__main__":
    main()
