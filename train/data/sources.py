"""Training data: sources -> canonical records -> (regeneration) -> tokens + loss masks -> train/eval split.

1. load: each source through `datasets` — a jsonl/json/parquet/csv/txt file, a directory of such
   files, a `save_to_disk` directory, or a hub dataset name (offline: an error saying to pass a file);
2. normalise: every record becomes one canonical row (the `CANONICAL` schema), whatever its format:
     chat        {"messages": [{"role", "content"}, ...]}
     sharegpt    {"conversations": [{"from", "value"}, ...]}       -> messages
     questions   {"turns": [str, ...]} (Spec-Bench / MT-bench)     -> user-only messages
     prompt_response {"prompt", "response"?}                        -> user (+ assistant) messages
     text        {"text"} (a .txt file: one record a line)          -> text
     tokens      {"input_ids", "loss_mask"?} (pre-tokenized; what regeneration writes for a target
                 without a chat template)                          -> tokens
3. regenerate the assistant turns with the target when asked (train/data/regen.py);
4. tokenize with loss masks, truncate or drop at max_length (train/data/tokens.py);
5. a seeded shuffle; the last `held_out` fraction of sequences is the eval split.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import datasets

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text"}
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "system": "system",
}
# Auto-detection: the first format whose key column is present wins.
FORMAT_KEYS = {
    "tokens": "input_ids",
    "chat": "messages",
    "sharegpt": "conversations",
    "questions": "turns",
    "prompt_response": "prompt",
    "text": "text",
}
CANONICAL = datasets.Features(
    {
        "kind": datasets.Value("string"),  # "chat" | "text" | "tokens"
        "messages": [{"role": datasets.Value("string"), "content": datasets.Value("string")}],
        "text": datasets.Value("string"),
        "input_ids": datasets.Sequence(datasets.Value("int64")),
        "loss_mask": datasets.Sequence(datasets.Value("int8")),
        "origin": datasets.Value("string"),  # "file:row" for error messages
    }
)


@dataclass
class RegenConfig:
    """Regeneration (self-distillation): the target writes the responses the drafter learns from."""

    enabled: bool = False  # replace/add every assistant turn with the target's own sample
    out_dir: str = ""  # jsonl shards go here (resumable); default DATA_HOME/regen/<target>-<settings digest>
    num_samples: int = 0  # with no data.source: this many sequences sampled from the start token alone
    samples_per_prompt: int = 1  # samples per source record (a 20-line story prompt file wants more)
    max_new_tokens: int = 512  # per generated turn
    temperature: float = 1.0  # 0 = greedy; 1.0 with top_p 1.0 samples the target's own distribution
    top_p: float = 1.0  # nucleus filter (1.0 = off)
    top_k: int = 0  # top-k filter (0 = off)
    batch_size: int = 32  # sequences generated together (left-padded)
    shard_size: int = 256  # records per jsonl shard: the unit of resuming and of splitting across ranks
    stop_ids: list[int] = field(default_factory=list)  # extra stop tokens besides the target's EOS (stories260K: [1])
    engine: Literal["auto", "hf", "vllm"] = "auto"  # auto: vLLM when importable or its side venv is built, else hf

    def __post_init__(self) -> None:
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError("regenerate needs temperature >= 0, 0 < top_p <= 1, top_k >= 0")
        if (
            min(self.max_new_tokens, self.batch_size, self.shard_size, self.samples_per_prompt) < 1
            or self.num_samples < 0
        ):
            raise ValueError("regenerate.max_new_tokens, batch_size, shard_size, samples_per_prompt must be >= 1")


@dataclass
class DataConfig:
    """Where the training text comes from and how it becomes token sequences."""

    source: str | list[str] = ""  # file(s), directories or hub names; "" = none (regenerate from the start token)
    split: str = "train"  # split read from a save_to_disk DatasetDict or a hub dataset
    format: Literal["auto", "chat", "sharegpt", "questions", "prompt_response", "text", "tokens"] = (
        "auto"  # record format
    )
    max_records: int = 0  # keep only the first N records of the sources (0 = all)
    max_length: int = 2048  # tokens per sequence
    overflow: Literal["truncate", "drop"] = "truncate"  # what to do with longer sequences
    chat_template: bool = True  # render chats with the tokenizer's template when it has one (False: plain rule)
    enable_thinking: bool | None = None  # template variable (Qwen3's thinking block on/off); None = template default
    held_out: float = 0.05  # fraction of sequences kept out for evaluation
    regenerate: RegenConfig = field(default_factory=RegenConfig)  # self-distillation settings

    def __post_init__(self) -> None:
        if self.max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {self.max_length}")
        if not 0 <= self.held_out < 1:
            raise ValueError(f"held_out must be in [0, 1), got {self.held_out}")
        if self.max_records < 0:
            raise ValueError("max_records must be >= 0")

    @property
    def sources(self) -> list[str]:
        return [self.source] if isinstance(self.source, str) and self.source else list(self.source or [])


class RecordError(ValueError):
    """A record that lacks a field its format needs."""


# --- 1. load ------------------------------------------------------------------------------------


def load_source(source: str, split: str = "train") -> datasets.Dataset:
    """One source as a `datasets.Dataset` (files and save_to_disk dirs locally; anything else from the hub)."""
    p = Path(source)
    if p.is_dir() and (
        (p / "dataset_info.json").exists() or (p / "dataset_dict.json").exists() or (p / "state.json").exists()
    ):
        ds = datasets.load_from_disk(str(p))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise ValueError(f"{p}: no split {split!r} (has {sorted(ds)}); set data.split")
            ds = ds[split]
        return ds
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.suffix in FILE_BUILDERS and not f.name.startswith((".", "_")))
        if not files:
            raise ValueError(
                f"{p}: a directory with no data files ({', '.join(FILE_BUILDERS)}) and not a save_to_disk dir"
            )
        kinds = {FILE_BUILDERS[f.suffix] for f in files}
        if len(kinds) > 1:
            raise ValueError(f"{p}: mixes file types {sorted(kinds)}; list the files separately in data.source")
        return datasets.load_dataset(kinds.pop(), data_files=[str(f) for f in files], split="train")
    if p.is_file():
        if p.suffix not in FILE_BUILDERS:
            raise ValueError(f"{p}: unsupported file type {p.suffix!r}; use one of {', '.join(FILE_BUILDERS)}")
        if p.stat().st_size == 0:
            raise ValueError(f"{p}: empty file")
        try:
            return datasets.load_dataset(FILE_BUILDERS[p.suffix], data_files=str(p), split="train")
        except Exception as e:  # noqa: BLE001 - datasets wraps a parse error in DatasetGenerationError
            raise ValueError(
                f"{unreadable_line(p) or p}: cannot read this {p.suffix} file ({type(e).__name__}); "
                "fix or remove the record"
            ) from None
    if source.startswith((".", "/", "~")) or p.suffix in FILE_BUILDERS or source.count("/") > 1:
        raise FileNotFoundError(f"data source not found: {source}")
    try:  # a hub dataset name
        return datasets.load_dataset(source, split=split)
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds here; all mean "not available"
        offline = os.environ.get("HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE") == "1"
        how = (
            "offline: download it on a connected machine (datasets.load_dataset(...).to_json('x.jsonl') or "
            "save_to_disk) and pass the local file or directory in data.source"
            if offline
            else "pass a local jsonl/json/parquet/csv/txt file or a save_to_disk directory in data.source"
        )
        raise FileNotFoundError(f"cannot load hub dataset {source!r} ({type(e).__name__}); {how}") from e


def unreadable_line(p: Path) -> str | None:
    """`file:line: not valid JSON (...)` for the first bad line of a jsonl file (None: not jsonl, or none found)."""
    if p.suffix != ".jsonl":
        return None
    with p.open(encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, start=1):
            try:
                if line.strip() and not isinstance(json.loads(line), dict):
                    return f"{p}:{n}: not a JSON object"
            except json.JSONDecodeError as e:
                return f"{p}:{n}: not valid JSON ({e.msg}, column {e.colno})"
    return None


def detect_format(columns: list[str], source: str) -> str:
    for fmt, key in FORMAT_KEYS.items():
        if key in columns:
            return fmt
    raise ValueError(
        f"{source}: cannot tell the record format from columns {columns}; expected one of "
        + ", ".join(f"{k} ({f})" for f, k in FORMAT_KEYS.items())
        + " — or set data.format"
    )


# --- 2. normalise -------------------------------------------------------------------------------


def _field(rec: dict, name: str, where: str, types: type | tuple = str) -> Any:
    v = rec.get(name)
    if v is None:
        raise RecordError(f"{where}: missing field '{name}'")
    if not isinstance(v, types):
        raise RecordError(
            f"{where}: field '{name}' should be {getattr(types, '__name__', types)}, got {type(v).__name__}"
        )
    return v


def normalise(rec: dict, fmt: str, where: str) -> dict:
    """One raw record -> one CANONICAL row. `where` ('file row N') goes into every error."""
    out = {"kind": "chat", "messages": [], "text": "", "input_ids": [], "loss_mask": [], "origin": where}
    if fmt == "chat":
        for j, m in enumerate(_field(rec, "messages", where, list)):
            at = f"{where}, messages[{j}]"
            if not isinstance(m, dict):
                raise RecordError(f"{at}: expected a {{role, content}} mapping")
            out["messages"].append({"role": _field(m, "role", at), "content": _field(m, "content", at)})
    elif fmt == "sharegpt":
        for j, m in enumerate(_field(rec, "conversations", where, list)):
            at = f"{where}, conversations[{j}]"
            if not isinstance(m, dict):
                raise RecordError(f"{at}: expected a {{from, value}} mapping")
            role = SHAREGPT_ROLES.get(_field(m, "from", at).lower())
            if role is None:
                raise RecordError(f"{at}: unknown speaker {m['from']!r} (known: {sorted(SHAREGPT_ROLES)})")
            out["messages"].append({"role": role, "content": _field(m, "value", at)})
    elif fmt == "questions":
        turns = _field(rec, "turns", where, list)
        out["messages"] = [{"role": "user", "content": _field({"turns": t}, "turns", where)} for t in turns]
    elif fmt == "prompt_response":
        out["messages"] = [{"role": "user", "content": _field(rec, "prompt", where)}]
        if rec.get("response") is not None:
            out["messages"].append({"role": "assistant", "content": _field(rec, "response", where)})
    elif fmt == "text":
        out.update(kind="text", text=_field(rec, "text", where))
    elif fmt == "tokens":
        ids = _field(rec, "input_ids", where, list)
        mask = rec.get("loss_mask")
        if mask is not None and len(mask) != len(ids):
            raise RecordError(f"{where}: loss_mask has {len(mask)} entries for {len(ids)} input_ids")
        out.update(kind="tokens", input_ids=ids, loss_mask=list(mask) if mask is not None else [1] * len(ids))
    else:
        raise ValueError(f"unknown data.format {fmt!r}")
    if out["kind"] == "chat" and not out["messages"]:
        raise RecordError(f"{where}: a conversation with no messages")
    return out


def load_records(cfg: DataConfig) -> datasets.Dataset:
    """All sources, normalised to the CANONICAL schema and concatenated (first `max_records` kept)."""
    parts = []
    for src in cfg.sources:
        raw = load_source(src, cfg.split)
        fmt = cfg.format if cfg.format != "auto" else detect_format(raw.column_names, src)
        name = Path(src).name if Path(src).exists() else src
        parts.append(
            raw.map(
                lambda r, i, fmt=fmt, name=name: normalise(r, fmt, f"{name} row {i}"),
                with_indices=True,
                remove_columns=raw.column_names,
                features=CANONICAL,
                keep_in_memory=True,
                desc=f"reading {name}",
            )
        )
    if not parts:
        return datasets.Dataset.from_dict({k: [] for k in CANONICAL}, features=CANONICAL)
    ds = datasets.concatenate_datasets(parts)
    if cfg.max_records:
        ds = ds.select(range(min(cfg.max_records, len(ds))))
    return ds
