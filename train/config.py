"""Typed recipe configs: nested dataclasses filled from a YAML file plus dotted `key=value` overrides.

`load_config(cls, path, overrides)` is generic (any nested dataclass tree); `load_recipe` builds the
top-level `Recipe` and fills the defaults that depend on the recipe file (name, run_dir).
Errors name the dotted key, the file, and the nearest valid key, so a typo fails before any work:

    recipe.yaml: unknown key 'data.max_lenght'; did you mean 'data.max_length'?

OmegaConf (structured configs in struct mode) checks and converts the types: int -> float, "1e-3" ->
float, Literal choices, X | None, tuple[X, ...] from a YAML list; a scalar is never made a list.
YAML files and override values are read with only true/false as booleans, so a string or Literal
setting keeps the words `no`, `off`, `yes`, `on` (a bool setting still accepts them). Then every
setting's range is checked (train/settings.py) before anything runs: one error naming key, value,
range and fix. To extend the recipe, add a dataclass field (and, if numeric, its range in CHECKS).

The `features` and `train` sections' dataclasses live here too, not next to the code that reads them:
this module is the leaf the rest of train/ imports (features, dataset, loop), so the graph has no cycle.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    MissingMandatoryValue,
    OmegaConfBaseException,
    ValidationError,
)

from decode.loading import DTYPES
from drafters.trainable.dflash import DFlashConfig
from drafters.trainable.dspark import DSparkConfig
from drafters.trainable.eagle import Eagle1Config
from drafters.trainable.eagle3 import Eagle3Config
from drafters.trainable.layerskip import LayerSkipConfig
from drafters.trainable.medusa import MedusaConfig
from train.data.sources import DataConfig
from train.settings import problems, read_yaml, unread_sections


class ConfigError(ValueError):
    """A recipe or override that does not fit the config schema."""


@dataclass
class FeaturesConfig:
    """Which target features the drafter trains on, and whether they are cached or computed in the step."""

    mode: Literal["offline", "online"] = "offline"  # offline = read the cache; online = run the target each step
    cache_dir: str = ""  # default DATA_HOME/features/<target>-<fingerprint digest> ($DRAFTSMITH_DATA)
    hidden_ids: list[int] = field(default_factory=list)  # hidden-state ids to keep (0 = embeddings .. L = final norm)
    dtype: Literal["fp32", "bf16", "fp16"] = "bf16"  # storage dtype of hidden states and top-k probs
    topk: int = 0  # store the target's k most likely next tokens + probs per position (0 = don't)
    shard_size: int = 64  # sequences per shard (a shard is held in memory until written)
    batch_size: int = 8  # sequences per target forward during extraction
    target_dtype: str = (
        "auto"  # frozen target's dtype: auto (decode.precision.resolve_dtype) | float32 | bfloat16 | float16
    )
    attn: str = "sdpa"  # attention implementation of the target (sdpa | eager)

    def __post_init__(self) -> None:
        if any(i < 0 for i in self.hidden_ids):
            raise ValueError(f"hidden_ids {self.hidden_ids}: ids are 0..L (0 = embeddings, L = final normed state)")
        if self.topk < 0 or self.shard_size < 1 or self.batch_size < 1:
            raise ValueError("topk must be >= 0, shard_size and batch_size >= 1")
        if self.target_dtype not in DTYPES and self.target_dtype != "auto":
            raise ValueError(f"target_dtype {self.target_dtype!r} not one of {['auto', *sorted(DTYPES)]}")


@dataclass
class TrainConfig:
    """Optimisation and bookkeeping for one run."""

    steps: int = 1000  # optimizer steps
    batch_size: int = 8  # sequences per process per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    pack_length: int = 0  # pack sequences into rows of this many tokens (0 = one sequence per row)
    max_sequences: int = 0  # train on only the first N (shuffled) train sequences of the data: more epochs over
    # less data from the same cache (0 = all; the held-out split is unchanged)
    lr: float = 3e-4  # peak learning rate
    weight_decay: float = 0.0  # AdamW weight decay
    beta1: float = 0.9  # AdamW beta1
    beta2: float = 0.95  # AdamW beta2
    optimizer: Literal["adamw", "muon"] = "adamw"  # muon: torch.optim.Muon on the drafter's matrices, AdamW on the rest
    loss: Literal["kl", "lk"] = "kl"  # distillation term: kl (each drafter's KL / soft CE) | lk (acceptance rate)
    lk_variant: Literal["lambda", "alpha"] = "lambda"  # lk: lambda (λ·KL + (1-λ)·(1-α)) | alpha (-log α)
    lk_eta: float = 3.0  # lk lambda: λ = lk_kl_scale * exp(-lk_eta * mean α), no gradient through λ (paper: 3)
    lk_kl_scale: float = 1.0  # lk lambda: the KL weight λ at zero acceptance, in [0, 1]
    warmup_steps: int = 20  # linear warmup from 0 to lr
    schedule: Literal["cosine", "linear", "constant"] = "cosine"  # decay after warmup
    min_lr_ratio: float = 0.1  # final lr as a fraction of lr (cosine and linear)
    max_grad_norm: float = 0.5  # clip the global gradient norm (0 = off)
    mixed_precision: Literal["auto", "no", "bf16"] = "auto"  # bf16 autocast of the drafter (fp32 weights and
    # optimizer state); auto = bf16 where decode.precision.resolve_dtype picks it, else no
    eval_every: int = 100  # evaluate on held-out data every N steps (0 = only at the end)
    eval_batches: int = 8  # held-out batches for the loss, accuracies and teacher-forced τ estimate
    tree_width: int = 4  # top-w accuracy used for the teacher-forced tree τ estimate
    sim_prompts: str = ""  # prompt file for the decoding-faithful τ (train/simeval.py); "" = held-out prefixes
    sim_prompt_len: int = 16  # held-out prefix prompts: tokens kept when only the start token precedes the text
    sim_eval_prompts: int = 32  # prompts the final eval decodes (0 = no decoding-faithful τ)
    sim_periodic_prompts: int = 4  # of those, the first N decoded by each periodic eval (kept cheap)
    sim_max_new_tokens: int = 128  # greedy tokens per prompt (the decoder's default)
    sim_chain: int = 8  # chain length k of the simulated chain (the decoder's default)
    sim_tree: str = "dynamic:topk=8,depth=6,nodes=60"  # tree shape of the simulated tree (the benchmarks')
    save_every: int = 200  # checkpoint every N steps (0 = only at the end)
    keep_checkpoints: int = 2  # newest checkpoints kept
    log_every: int = 10  # metrics line every N steps
    report_to: Literal["wandb", "tensorboard", "none"] = "wandb"  # experiment tracker (wandb offline by default)
    resume: str = "auto"  # auto (newest checkpoint if any) | never | a checkpoint directory
    init_from: str = ""  # warm start: a trained drafter directory (native or engine layout) of the same kind
    # and shape whose weights the run starts from (its own checkpoints win on resume); "" = fresh weights
    num_workers: int = 0  # DataLoader workers
    threads: int = 0  # torch CPU threads per process (0 = torch's default; 1 is fastest for tiny models)
    eval_only: bool = False  # only evaluate the newest checkpoint (else init_from's drafter, else the untrained one): no training, no export


@dataclass
class DrafterSection:
    """The drafter to train: `kind` picks one of the sections below; only that section is used."""

    kind: Literal["", "eagle3", "eagle1", "medusa", "layerskip", "dflash", "dspark"] = ""  # drafter family ("" = none)
    eagle3: Eagle3Config = field(default_factory=Eagle3Config)  # EAGLE-3 settings
    eagle1: Eagle1Config = field(default_factory=Eagle1Config)  # EAGLE-1 settings
    medusa: MedusaConfig = field(default_factory=MedusaConfig)  # Medusa settings
    layerskip: LayerSkipConfig = field(default_factory=LayerSkipConfig)  # LayerSkip settings
    dflash: DFlashConfig = field(default_factory=DFlashConfig)  # DFlash (block drafter) settings
    dspark: DSparkConfig = field(default_factory=DSparkConfig)  # DSpark (DFlash + Markov/confidence heads) settings

    def selected(self):
        """The config dataclass of the chosen kind."""
        return getattr(self, self.kind)


@dataclass
class Recipe:
    """One YAML recipe: what to train on which frozen target, and where the run lives."""

    target: str  # model directory or hub id of the frozen target (required)
    run_dir: str = ""  # where logs, checkpoints and export/ go; default runs/<recipe file stem>
    name: str = ""  # run name for logs; default the recipe file stem
    seed: int = 0  # seeds regeneration, the held-out split, shuffling and training
    data: DataConfig = field(default_factory=DataConfig)  # sources, tokenization, regeneration
    features: FeaturesConfig = field(default_factory=FeaturesConfig)  # frozen-target features (offline/online)
    drafter: DrafterSection = field(default_factory=DrafterSection)  # which drafter, and its settings
    train: TrainConfig = field(default_factory=TrainConfig)  # optimisation and bookkeeping


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> Recipe:
    """Load a recipe YAML (+ overrides) and fill its path defaults from the file stem."""
    path = Path(path)
    r = load_config(Recipe, path, list(overrides))
    for w in unread_sections(r.drafter.kind, given_keys(path, overrides)):
        print(f"warning: {w}", file=sys.stderr)
    name = r.name or path.stem
    run_dir = r.run_dir or str(Path("runs") / path.stem)
    # data.regenerate.out_dir and features.cache_dir stay "" unless set: their default directories are
    # keyed by the target and settings under the data home, known once the target is loaded (train/data/identity.py).
    return dataclasses.replace(r, name=name, run_dir=run_dir)


def with_feature_ids(recipe: Recipe, num_layers: int) -> Recipe:
    """Fill `features.hidden_ids` from the drafter (when empty) or check it holds what the drafter needs."""
    if not recipe.drafter.kind:
        if not recipe.features.hidden_ids:
            raise ConfigError(
                "features.hidden_ids is empty and no drafter.kind is set: name the drafter "
                "(drafter.kind=eagle3|eagle1|medusa|layerskip|dflash|dspark) or list the hidden-state ids "
                "(0 = embeddings, i = layer i output, L = final normed state), e.g. features.hidden_ids=[2,3,5]"
            )
        return recipe
    need = sorted(recipe.drafter.selected().feature_ids(num_layers))
    have = list(recipe.features.hidden_ids)
    if not have:
        return dataclasses.replace(recipe, features=dataclasses.replace(recipe.features, hidden_ids=need))
    missing = sorted(set(need) - set(have))
    if missing:
        raise ConfigError(
            f"features.hidden_ids {have} lacks {missing}, which a {recipe.drafter.kind} drafter needs "
            f"for a {num_layers}-layer target; remove the key to use {need}"
        )
    return recipe


def load_config(cls: type, yaml_path: str | Path | None, overrides: Sequence[str] = ()) -> Any:
    """Build dataclass `cls` from a YAML mapping and dotted `a.b=value` overrides (values parsed as YAML).

    OmegaConf does the work: the dataclass is its schema in struct mode, so an unknown key, a value of
    the wrong type or outside a Literal's choices fails at the merge that brings it in. Ours: the file
    and override checks, naming the file or override in each error, the nearest valid key, and the
    ranges of train/settings.py.
    """
    where = str(yaml_path) if yaml_path is not None else "<defaults>"
    cfg = OmegaConf.structured(cls, flags={"struct": True})
    if yaml_path is not None:
        cfg = _merge(cfg, read_file(Path(yaml_path)), str(yaml_path))
    parsed = [(ov, parse_override(ov)) for ov in overrides]
    try:  # one merge for all overrides (each merge copies the whole tree); on a failure, one by one to name it
        cfg = _merge(cfg, OmegaConf.merge(*[d for _, d in parsed]), "overrides") if parsed else cfg
    except (ConfigError, OmegaConfBaseException):
        for ov, dot in parsed:
            cfg = _merge(cfg, dot, f"override {ov!r}")
    bad = problems(lambda key: OmegaConf.select(cfg, key, default=None, throw_on_missing=False))
    if bad:
        key, msg = bad[0]
        setters = [ov for ov in overrides if ov.partition("=")[0].strip() in (key, key.rpartition(".")[0])]
        raise ConfigError(f"{f'override {setters[-1]!r}' if setters else where}: {msg}")
    try:
        return OmegaConf.to_object(cfg)
    except MissingMandatoryValue as e:
        raise ConfigError(f"{where}: missing required key '{e.full_key}'") from None
    except OmegaConfBaseException as e:  # e.g. a ${...} interpolation that names no key
        raise ConfigError(f"{where}: '{e.full_key}': {str(e).splitlines()[0]}") from None
    except (ValueError, TypeError) as e:  # __post_init__ validation
        raise ConfigError(f"{where}: {e}") from e


def read_file(p: Path) -> DictConfig:
    """A recipe file as an (untyped) DictConfig; bad YAML names the line."""
    if not p.is_file():
        raise ConfigError(f"recipe file not found: {p}")
    try:
        raw = OmegaConf.create(read_yaml(p.read_text(encoding="utf-8")) or {})
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{p}:{mark.line + 1}" if mark is not None else str(p)
        raise ConfigError(
            f"{where}: not valid YAML ({getattr(e, 'problem', None) or type(e).__name__}); fix "
            "that line (YAML wants `key: value`, nested keys indented)"
        ) from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"{p}: {str(e).splitlines()[0]}") from None
    if not isinstance(raw, DictConfig):
        raise ConfigError(f"{p}: the top level must be a mapping of keys, got a {type(raw).__name__}")
    return raw


def parse_override(ov: str) -> DictConfig:
    """`a.b=value` as the nested mapping {a: {b: value}}, the value read as YAML (true/false the only booleans)."""
    key, eq, text = ov.partition("=")
    if not eq or not key.strip():
        raise ConfigError(f"override {ov!r} must look like key=value (dotted keys for nested fields)")
    try:
        value = read_yaml(text) if text.strip() else ""  # an empty value is "" (YAML would read null)
    except yaml.YAMLError as e:
        raise ConfigError(f"override {ov!r}: the value is not valid YAML: {' '.join(str(e).split())}") from None
    for part in reversed(key.strip().split(".")):
        value = {part: value}
    return OmegaConf.create(value)


def given_keys(yaml_path: str | Path, overrides: Sequence[str]) -> set[str]:
    """The dotted keys the recipe file and the overrides set (leaves only)."""

    def leaves(d: Any, prefix: str) -> list[str]:
        if isinstance(d, dict) and d:
            return [k for name, v in d.items() for k in leaves(v, f"{prefix}{name}.")]
        return [prefix[:-1]]

    raw = OmegaConf.to_container(read_file(Path(yaml_path)))
    return set(leaves(raw, "")) | {ov.partition("=")[0].strip() for ov in overrides}


def _merge(cfg: DictConfig, other: DictConfig, where: str) -> DictConfig:
    """cfg merged with other, OmegaConf's errors turned into one line that names `where` and the key."""
    try:
        return OmegaConf.merge(cfg, other)
    except (ConfigKeyError, ConfigAttributeError) as e:
        parent, _, key = (e.full_key or "").rpartition(".")
        valid = list(OmegaConf.select(cfg, parent) if parent else cfg)
        near = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
        prefix = parent + "." if parent else ""
        hint = f"did you mean '{prefix}{near[0]}'?" if near else f"valid keys here: {', '.join(sorted(valid))}"
        raise ConfigError(f"{where}: unknown key '{e.full_key}'; {hint}") from None
    except ValidationError as e:
        at = f"'{e.full_key}': " if e.full_key else ""  # OmegaConf 2.4 names no key for a bad tuple element
        msg = str(e).splitlines()[0]
        fix = f"; set {e.full_key} to one of them" if e.full_key and "expected one of" in msg else ""
        raise ConfigError(f"{where}: {at}{msg}{fix}") from None


def to_dict(cfg: Any) -> dict[str, Any]:
    """A plain nested dict (for writing the resolved config next to a run)."""
    return dataclasses.asdict(cfg)


def dump_config(cfg: Any, path: str | Path) -> None:
    """Write the resolved config as YAML (parents created). A recipe keeps only its chosen drafter's section:
    the others are never read, and loading the file back (train.snapshot) would warn about each of their keys."""
    d = to_dict(cfg)
    drafter = d.get("drafter")
    if isinstance(drafter, dict) and drafter.get("kind"):
        d["drafter"] = {k: v for k, v in drafter.items() if k == "kind" or k == drafter["kind"]}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(yaml.safe_dump(d, sort_keys=False))
