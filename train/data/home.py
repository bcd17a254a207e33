"""`draftsmith data ls` and `draftsmith data rm KEY ... | --older-than DAYS`: the data home, kept by the user.

The data home ($DRAFTSMITH_DATA, default ~/.cache/draftsmith/data; train/data/identity.py) holds regenerated
sets (regen/<target>-<digest>), feature caches (features/<target>-<digest>; terabytes for a 14B target)
and ShareGPT (sharegpt/). Each entry is listed with its size, the target and settings it was made from
(read from what the entry already records: the regen manifest, the cache's index and recipe) and its
last use. Jobs mark what they use (`use`, called where a run opens an entry):

    ENTRY/.last_used.json   when and by which target it was last used (a rerun that reuses it counts)
    ENTRY/.lock.PID.json    held while the process PID runs; `rm` refuses such an entry. A lock whose
                            process is gone (a killed job) is stale and ignored.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from train.data.identity import data_home

KINDS = ("regen", "features")  # keyed directories, one entry each; sharegpt/ is one entry as a whole
STAMP, LOCK = ".last_used.json", ".lock.{pid}.json"  # files, not a directory: an entry stays a flat folder


# --- marking use (called by jobs) ----------------------------------------------------------------


def use(entry: Path, target: str = "") -> None:
    """Record that this process uses `entry` now: the last-used stamp, and a lock held until it exits."""
    entry.mkdir(parents=True, exist_ok=True)
    stamp = {"time": time.time(), "target": target, "pid": os.getpid()}
    tmp = entry / f"{STAMP}.{os.getpid()}.part"  # not `.*.tmp`: regen/features sweep those away as strays
    tmp.write_text(json.dumps(stamp))
    os.replace(tmp, entry / STAMP)
    lock = entry / LOCK.format(pid=os.getpid())
    if not lock.exists():
        lock.write_text(
            json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(), "argv": sys.argv[:4]})
        )
        atexit.register(lambda: lock.unlink(missing_ok=True))  # a SIGKILL skips this: a stale lock, ignored


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def holders(entry: Path) -> list[int]:
    """PIDs of other live processes (on this host) holding `entry`; stale locks are skipped."""
    out = []
    for p in sorted(entry.glob(LOCK.format(pid="*"))):
        try:
            lock = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            continue  # a lock being written: its owner is alive only if its pid says so, read next time
        pid, host = int(lock.get("pid", 0)), lock.get("host")
        if pid and pid != os.getpid() and (host != socket.gethostname() or alive(pid)):
            out.append(pid)  # another host's lock cannot be checked: held
    return out


# --- listing ------------------------------------------------------------------------------------


@dataclass
class Entry:
    """One thing the data home holds."""

    key: str  # regen/<name>, features/<name>, sharegpt
    path: Path
    bytes: int
    target: str  # the target it was made from (path or name), as recorded
    settings: str  # the settings, in a few words
    last_used: float  # seconds since the epoch (the stamp, else the newest file)
    held_by: list[int]  # live processes using it


def size_and_newest(path: Path) -> tuple[int, float]:
    size, newest = 0, path.stat().st_mtime
    for p in path.rglob("*"):
        if p.is_file():
            st = p.stat()
            size, newest = size + st.st_size, max(newest, st.st_mtime)
    return size, newest


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def describe(kind: str, path: Path) -> tuple[str, str]:
    """(target, settings) from what the entry records."""
    if kind == "regen":
        m = read_json(path / "_regen.json")
        s = m.get("settings", {})
        words = [
            f"{m.get('jobs', '?')} sequences",
            f"max_new_tokens {s.get('max_new_tokens', '?')}",
            f"temperature {s.get('temperature', '?')}",
            f"top_p {s.get('top_p', '?')}",
            f"seed {m.get('seed', '?')}",
        ]
        return "", ", ".join(words) if m else "no manifest (unfinished or foreign)"
    if kind == "features":
        idx = read_json(path / "index.json")
        target = ""
        if (path / "recipe.yaml").exists():
            import yaml

            target = str((yaml.safe_load((path / "recipe.yaml").read_text()) or {}).get("target", ""))
        if not idx:
            return target, "no index (unfinished: rerun the recipe to finish it)"
        return target, (
            f"{idx.get('num_sequences')} sequences, {idx.get('tokens')} tokens, hidden ids "
            f"{idx.get('hidden_ids')}, {idx.get('dtype')}, topk {idx.get('topk')}"
        )
    files = sorted(p.name for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
    return "", f"ShareGPT: {', '.join(files) or 'empty'}"


def entries(home: Path | None = None) -> list[Entry]:
    """Everything under the data home, regen first, then features, then sharegpt."""
    home = home or data_home()
    found = [(k, p) for k in KINDS if (home / k).is_dir() for p in sorted((home / k).iterdir()) if p.is_dir()]
    if (home / "sharegpt").is_dir():
        found.append(("sharegpt", home / "sharegpt"))
    out = []
    for kind, path in found:
        size, newest = size_and_newest(path)
        stamp = read_json(path / STAMP)
        target, settings = describe(kind, path)
        name = path.name.rsplit("-", 1)[0] if kind in KINDS else ""
        out.append(
            Entry(
                f"{kind}/{path.name}" if kind in KINDS else kind,
                path,
                size,
                target or stamp.get("target") or name,
                settings,
                stamp.get("time", newest),
                holders(path),
            )
        )
    return out


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def age(t: float, now: float) -> str:
    d = max(0.0, now - t)
    return (
        f"{d / 86400:.1f} days ago" if d >= 86400 else f"{d / 3600:.1f} h ago" if d >= 3600 else f"{d / 60:.0f} min ago"
    )


# --- removing -----------------------------------------------------------------------------------


def pick(all_entries: list[Entry], keys: list[str], older_than: float | None, now: float) -> list[Entry]:
    """The entries `rm` would remove: named ones (a key, or its unique last part), or those unused for longer
    than `older_than` days. An unknown key is an error naming what there is."""
    if older_than is not None:
        return [e for e in all_entries if now - e.last_used > older_than * 86400]
    by_key = {e.key: e for e in all_entries}
    out = []
    for k in keys:
        k = k.rstrip("/")
        match = [by_key[k]] if k in by_key else [e for e in all_entries if e.key.split("/")[-1] == k]
        if len(match) != 1:
            have = ", ".join(sorted(by_key)) or "nothing"
            raise ValueError(
                f"data rm {k}: {'no such entry' if not match else 'ambiguous'} in {data_home()} "
                f"(it holds: {have}); see `draftsmith data ls`"
            )
        out.append(match[0])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="draftsmith data", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("ls", help="list the data home: size, target, settings, last use, in use")
    ls.add_argument("--json", action="store_true", help="one JSON object per entry")
    rm = sub.add_parser("rm", help="remove entries (never one a running job holds)")
    rm.add_argument("keys", nargs="*", help="entry keys as `data ls` shows them (or their last part)")
    rm.add_argument("--older-than", type=float, metavar="DAYS", help="remove every entry unused for DAYS days")
    rm.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    args = ap.parse_args(argv)
    now, home = time.time(), data_home()
    found = entries(home)
    if args.cmd == "ls":
        return list_entries(found, home, now, args.json)
    if bool(args.keys) == (args.older_than is not None):
        raise ValueError("data rm: give entry keys or --older-than DAYS (one of them); see `draftsmith data ls`")
    if args.older_than is not None and args.older_than < 0:
        raise ValueError(f"data rm --older-than {args.older_than:g}: DAYS must be >= 0")
    chosen = pick(found, args.keys, args.older_than, now)
    held = [e for e in chosen if e.held_by]
    if held and args.keys:  # named explicitly: refuse outright, remove nothing
        e = held[0]
        raise ValueError(
            f"data rm {e.key}: in use by running process(es) {e.held_by}; wait for them to finish "
            "(or stop them), then rerun"
        )
    for e in held:
        print(f"[data] kept {e.key}: in use by running process(es) {e.held_by}")
    for e in (e for e in chosen if not e.held_by):
        print(
            f"[data] {'would remove' if args.dry_run else 'removing'} {e.key} ({human_bytes(e.bytes)}, last used "
            f"{age(e.last_used, now)})"
        )
        if not args.dry_run:
            shutil.rmtree(e.path)
    if not chosen:
        print(f"[data] nothing to remove in {home}")
    return 0


def list_entries(found: list[Entry], home: Path, now: float, as_json: bool) -> int:
    if as_json:
        for e in found:
            print(
                json.dumps(
                    {
                        "key": e.key,
                        "path": str(e.path),
                        "bytes": e.bytes,
                        "target": e.target,
                        "settings": e.settings,
                        "last_used": e.last_used,
                        "held_by": e.held_by,
                    }
                )
            )
        return 0
    print(
        f"data home {home}: {len(found)} entr{'y' if len(found) == 1 else 'ies'}, "
        f"{human_bytes(sum(e.bytes for e in found))}"
    )
    for e in found:
        busy = f"  IN USE by pid {', '.join(map(str, e.held_by))}" if e.held_by else ""
        print(
            f"{e.key}\n    {human_bytes(e.bytes)}, last used {time.strftime('%Y-%m-%d %H:%M', time.localtime(e.last_used))} "
            f"({age(e.last_used, now)}){busy}\n    target {e.target or '?'}; {e.settings}"
        )
    return 0


if __name__ == "__main__":
    from decode.errors import run_cli

    sys.exit(run_cli(main))
