"""Options inside a command-line value, `NAME:key=value,...` (drafter SPECs, --policy): one parser, one message."""

from __future__ import annotations

from decode.errors import TYPE_NAMES


def parse_kv(arg: str, defaults: dict[str, int | float], what: str) -> dict[str, int | float]:
    """`a=1,b=2` -> dict, checked against `defaults` (which also give the types); `what` names the value in
    errors (e.g. "drafter 'lookahead:x=1'")."""
    out = dict(defaults)
    for part in filter(None, arg.split(",")):
        key, eq, val = part.partition("=")
        if not eq or key not in defaults:
            raise ValueError(f"{what}: option {part!r} not one of {sorted(defaults) or 'none'} (form key=value)")
        try:
            out[key] = type(defaults[key])(val)
        except ValueError:
            raise ValueError(f"{what}: {key} needs {TYPE_NAMES[type(defaults[key])]}, got {val!r}") from None
    return out
