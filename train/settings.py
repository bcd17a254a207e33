"""Every recipe setting checked before any work starts: the allowed range of each numeric, word and path
setting, keyed by its dotted name, and the YAML reading that keeps `no`/`off`/`yes`/`on` words.

Types and Literal choices are OmegaConf's job (train/config.py merges into the typed dataclass schema, so
a new Literal field is checked with no entry here). What a type cannot say — an integer >= 1, a
probability in [0, 1), a dtype name, a file that must exist — is a `Check` in `CHECKS`; a test
(tests/train/test_config.py) fails when a numeric field of the schema has no entry, so a new setting
cannot be forgotten. A failed check is one line naming the key, the value, the range and the fix:

    train.grad_accum=0: must be an integer >= 1 (micro-batches per optimizer step); set train.grad_accum=1 or more
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

# YAML 1.1 reads yes/no/on/off/y/n as booleans, so `mixed_precision: no` arrived as False and was refused
# by its own documented word. Here only true/false are booleans; a bool field still takes the words
# (OmegaConf converts "yes"/"no"/"on"/"off" strings for bool fields), and a string field keeps them.
_BOOL_TAG = "tag:yaml.org,2002:bool"
_TRUE_FALSE = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")


def yaml_loader() -> type:
    """OmegaConf's YAML loader (1e-3 is a float, duplicate keys refused), true/false the only booleans."""
    from omegaconf._yaml import get_yaml_loader

    base = get_yaml_loader()
    resolvers = {
        ch: [(tag, rx) for tag, rx in rs if tag != _BOOL_TAG] for ch, rs in base.yaml_implicit_resolvers.items()
    }
    loader = type("WordsStayWords", (base,), {"yaml_implicit_resolvers": resolvers})
    loader.add_implicit_resolver(_BOOL_TAG, _TRUE_FALSE, list("tTfF"))
    return loader


def read_yaml(text: str) -> Any:
    return yaml.load(text, Loader=yaml_loader())  # noqa: S506 (a safe loader: OmegaConf's, BaseLoader-based)


@dataclass(frozen=True)
class Check:
    """One setting's allowed values: `ok(value)` and the words for the message (`must be ...`)."""

    ok: Callable[[Any], bool]
    allowed: str  # "an integer >= 1", "in [0, 1)", "one of ['ce', 'kl']"
    fix: str = "set {key} to a value in that range"  # what to do; {key} is the dotted key


def at_least(lo: int | float, what: str = "") -> Check:
    kind = "an integer" if isinstance(lo, int) else "a number"
    return Check(lambda v: v >= lo, f"{kind} >= {lo}{f' ({what})' if what else ''}", f"set {{key}}={lo} or more")


def above(lo: float, what: str = "") -> Check:
    return Check(lambda v: v > lo, f"a number > {lo}{f' ({what})' if what else ''}", "set {key} to a positive number")


def within(lo: float, hi: float, lo_open: bool = False, hi_open: bool = False, what: str = "") -> Check:
    def ok(v: float) -> bool:
        return (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)

    text = f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    return Check(ok, f"{text}{f' ({what})' if what else ''}")


def one_of(*words: str) -> Check:
    return Check(lambda v: v in words, f"one of {list(words)}", "set {key} to one of them")


def each(check: Check) -> Check:
    return Check(
        lambda v: all(check.ok(x) for x in v),
        f"a list of values each {check.allowed}",
        "fix the values out of that range in {key}",
    )


def existing_file(what: str) -> Check:
    return Check(
        lambda v: not v or Path(v).is_file(),
        f"an existing file ({what}) or empty",
        "point it at a file that exists, or leave it empty",
    )


def _tree_spec(v: str) -> bool:
    from decode.tree import parse_shape

    try:
        parse_shape(v)
    except (ValueError, FileNotFoundError):
        return False
    return True


def _dtype_names() -> list[str]:
    from decode.loading import DTYPES

    return sorted(DTYPES)


POS, NONNEG = at_least(1), at_least(0)
PROB = within(0, 1, hi_open=True, what="a probability")
DECAY = within(0, 1, lo_open=True, what="a loss weight decay per step")
CHECKS: dict[str, Check] = {
    "seed": NONNEG,
    # data.*
    "data.max_records": at_least(0, "0 = all"),
    "data.max_length": at_least(2, "tokens per sequence"),
    "data.held_out": within(0, 1, hi_open=True, what="fraction kept for evaluation"),
    "data.regenerate.num_samples": NONNEG,
    "data.regenerate.samples_per_prompt": POS,
    "data.regenerate.max_new_tokens": POS,
    "data.regenerate.temperature": at_least(0.0, "0 = greedy"),
    "data.regenerate.top_p": within(0, 1, lo_open=True, what="1.0 = off"),
    "data.regenerate.top_k": at_least(0, "0 = off"),
    "data.regenerate.batch_size": POS,
    "data.regenerate.shard_size": POS,
    "data.regenerate.stop_ids": each(NONNEG),
    # features.*
    "features.hidden_ids": each(at_least(0, "0 = embeddings .. L = final normed state")),
    "features.topk": at_least(0, "0 = don't store"),
    "features.shard_size": POS,
    "features.batch_size": POS,
    "features.target_dtype": Check(
        lambda v: v == "auto" or v in _dtype_names(),
        "auto (bf16 where it pays) or a dtype name: float32 | bfloat16 | float16 (or fp32, bf16, fp16)",
    ),
    "features.attn": one_of("sdpa", "eager"),
    # train.*
    "train.steps": at_least(0, "optimizer steps; 0 only with train.eval_only=true"),
    "train.batch_size": at_least(1, "sequences per micro-batch"),
    "train.grad_accum": at_least(1, "micro-batches per optimizer step"),
    "train.max_sequences": at_least(0, "0 = every train sequence"),
    "train.pack_length": at_least(0, "0 = no packing"),
    "train.lr": above(0.0, "the peak learning rate"),
    "train.weight_decay": at_least(0.0),
    "train.beta1": within(0, 1, hi_open=True),
    "train.beta2": within(0, 1, hi_open=True),
    "train.warmup_steps": NONNEG,
    "train.min_lr_ratio": within(0, 1),
    "train.max_grad_norm": at_least(0.0, "0 = off"),
    "train.eval_every": at_least(0, "0 = only at the end"),
    "train.eval_batches": POS,
    "train.tree_width": POS,
    "train.sim_prompts": existing_file("a prompt file"),
    "train.sim_prompt_len": POS,
    "train.sim_eval_prompts": at_least(0, "0 = no simulated tau"),
    "train.sim_periodic_prompts": NONNEG,
    "train.sim_max_new_tokens": POS,
    "train.sim_chain": POS,
    "train.sim_tree": Check(_tree_spec, "a tree shape: chain | static:FILE | dynamic:topk=8,depth=6,nodes=60"),
    "train.save_every": at_least(0, "0 = only at the end"),
    "train.keep_checkpoints": POS,
    "train.log_every": POS,
    "train.resume": Check(
        lambda v: v in ("auto", "never") or Path(v).is_dir(),
        "auto | never | a checkpoint directory",
        "set train.resume=auto, never, or an existing checkpoints/step_N directory",
    ),
    "train.num_workers": NONNEG,
    "train.threads": at_least(0, "0 = torch's default"),
    "train.lk_eta": at_least(0.0, "how fast the KL weight decays with acceptance; 0 = a fixed blend"),
    "train.lk_kl_scale": within(0, 1, what="the KL weight at zero acceptance"),
    # drafter.*
    "drafter.eagle3.capture_ids": each(NONNEG),
    "drafter.eagle3.draft_vocab_size": POS,
    "drafter.eagle3.intermediate_size": at_least(0, "0 = the target's"),
    "drafter.eagle3.ttt_steps": POS,
    "drafter.eagle3.step_decay": DECAY,
    "drafter.eagle1.intermediate_size": at_least(0, "0 = the target's"),
    "drafter.eagle1.ce_weight": at_least(0.0),
    "drafter.eagle1.feature_noise": at_least(0.0),
    "drafter.eagle1.eval_depth": POS,
    "drafter.eagle3.noise_std": at_least(0.0, "gaussian std / uniform half-width / relative std"),
    "drafter.eagle1.noise_std": at_least(0.0, "gaussian std / uniform half-width / relative std"),
    "drafter.layerskip.lora_layers": each(NONNEG),
    "drafter.medusa.num_heads": POS,
    "drafter.medusa.num_layers": POS,
    "drafter.medusa.loss": one_of("ce", "kl"),
    "drafter.medusa.step_decay": DECAY,
    "drafter.layerskip.mode": one_of("exit_head", "lora", "full"),
    "drafter.layerskip.exits": each(POS),
    "drafter.layerskip.draft_exit": at_least(0, "0 = L // 4"),
    "drafter.layerskip.adapter_rank": NONNEG,
    "drafter.layerskip.loss": one_of("kl", "ce"),
    "drafter.layerskip.scale": one_of("uniform", "linear", "sum", "sqrt", "inv", "inv_sqrt"),
    "drafter.layerskip.curriculum": one_of("none", "rotational", "gradual"),
    "drafter.layerskip.rotation_every": POS,
    "drafter.layerskip.curriculum_steps": POS,
    "drafter.layerskip.gradual_fraction": within(0, 1),
    "drafter.layerskip.lora_rank": POS,
    "drafter.layerskip.lora_alpha": POS,
    "drafter.layerskip.lora_dropout": PROB,
    "drafter.layerskip.layer_dropout": PROB,
    "drafter.layerskip.eval_depth": POS,
    "drafter.dflash.capture_ids": each(NONNEG),
    "drafter.dflash.num_layers": POS,
    "drafter.dflash.block_size": at_least(2, "the anchor + at least 1 masked position"),
    "drafter.dflash.mask_token_id": at_least(-1, "-1 = a learned mask embedding, else a token id of the target"),
    "drafter.dflash.intermediate_size": at_least(0, "0 = the target's"),
    "drafter.dflash.anchors": POS,
    "drafter.dflash.ce_weight": at_least(0.0),
    "drafter.dflash.l1_weight": at_least(0.0),
    "drafter.dflash.gamma": above(0.0, "the position decay's scale"),
    "drafter.dflash.draft_vocab_size": at_least(0, "0 = the target's whole vocabulary"),
    "drafter.dspark.capture_ids": each(NONNEG),
    "drafter.dspark.num_layers": POS,
    "drafter.dspark.block_size": at_least(2, "the anchor + at least 1 masked position"),
    "drafter.dspark.mask_token_id": at_least(-1, "-1 = a learned mask embedding, else a token id of the target"),
    "drafter.dspark.intermediate_size": at_least(0, "0 = the target's"),
    "drafter.dspark.anchors": POS,
    "drafter.dspark.ce_weight": at_least(0.0),
    "drafter.dspark.l1_weight": at_least(0.0),
    "drafter.dspark.gamma": above(0.0, "the position decay's scale"),
    "drafter.dspark.draft_vocab_size": at_least(0, "0 = the target's whole vocabulary"),
    "drafter.dspark.markov_rank": POS,
    "drafter.dspark.conf_weight": at_least(0.0),
}
FREE_TEXT = {
    "target",
    "run_dir",
    "name",
    "data.source",
    "data.split",
    "data.regenerate.out_dir",
    "features.cache_dir",
    "train.init_from",
    "drafter.layerskip.lora_targets",
}  # string settings any text may fill (checked where they are read)


def problems(get: Callable[[str], Any]) -> list[tuple[str, str]]:
    """(key, message) for each setting that breaks its check, then the cross-setting rules. `get(key)`
    reads a value (None: not in this schema)."""
    out = []
    for key, c in CHECKS.items():
        v = get(key)
        if v is not None and not c.ok(v):
            out.append((key, f"{key}={_show(v)}: must be {c.allowed}; {c.fix.format(key=key)}"))
    if get("train.steps") == 0 and not get("train.eval_only"):
        out.append(
            (
                "train.steps",
                "train.steps=0: trains nothing and would export an untrained drafter; set "
                "train.steps >= 1, or train.eval_only=true to only evaluate the newest checkpoint",
            )
        )
    kind = get("drafter.kind")
    if get("train.loss") == "lk" and kind in ("medusa", "layerskip") and get(f"drafter.{kind}.loss") == "ce":
        from drafters.trainable.lk import label_conflict

        out.append(("train.loss", label_conflict(kind)))
    pack, length = get("train.pack_length"), get("data.max_length")
    if pack and length and 0 < pack < length:
        out.append(
            (
                "train.pack_length",
                f"train.pack_length={pack}: must be 0 or >= data.max_length ({length}): "
                f"a row holds whole sequences; set train.pack_length={length} or more, or 0",
            )
        )
    return out


def unread_sections(kind: str, keys: Iterable[str]) -> list[str]:
    """Warnings for settings under a drafter section the chosen drafter never reads."""
    out = []
    for key in sorted(set(keys)):
        parts = key.split(".")
        if kind and len(parts) > 2 and parts[0] == "drafter" and parts[1] != kind:
            out.append(
                f"{key} is set but drafter.kind is {kind!r}, which never reads the drafter.{parts[1]} section; "
                f"remove it, or set drafter.kind={parts[1]}"
            )
    return out


def _show(v: Any) -> str:
    return str(list(v)) if not isinstance(v, str) and hasattr(v, "__iter__") else str(v)  # a ListConfig too
