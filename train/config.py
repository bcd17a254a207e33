"""Typed recipe configs: nested dataclasses filled from a YAML file plus dotted `key=value` overrides.

`load_config(cls, path, overrides)` is generic (any nested dataclass tree); `load_recipe` builds the
top-level `Recipe` and fills the defaults that depend on the recipe file (name, run_dir).
Errors name the dotted key, the file, and the nearest valid key, so a typo fails before any work:

    recipe.yaml: unknown key 'data.max_lenght'; did you mean 'data.max_length'?

Types are checked and converted where the conversion is lossless (int -> float, a scalar -> a
one-element list is NOT done: lists must be lists). `dict[str, Any]` fields are taken as they are.
To extend the recipe, add a dataclass field; nothing else needs to change.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from drafters.eagle import Eagle1Config, Eagle3Config
from drafters.layerskip import LayerSkipConfig
from drafters.medusa import MedusaConfig
from train.data import DataConfig
from train.features import FeaturesConfig
from train.loop import TrainConfig


class ConfigError(ValueError):
    """A recipe or override that does not fit the config schema."""


@dataclass
class DrafterSection:
    """The drafter to train: `kind` picks one of the sections below; only that section is used."""

    kind: Literal["", "eagle3", "eagle1", "medusa", "layerskip"] = ""  # drafter family ("" = none: features only)
    eagle3: Eagle3Config = field(default_factory=Eagle3Config)  # EAGLE-3 settings
    eagle1: Eagle1Config = field(default_factory=Eagle1Config)  # EAGLE-1 settings
    medusa: MedusaConfig = field(default_factory=MedusaConfig)  # Medusa settings
    layerskip: LayerSkipConfig = field(default_factory=LayerSkipConfig)  # LayerSkip settings

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
    name = r.name or path.stem
    run_dir = r.run_dir or str(Path("runs") / path.stem)
    # data.regenerate.out_dir and features.cache_dir stay "" unless set: their default directories are
    # keyed by the target and settings under the data home, known once the target is loaded (train/identity.py).
    return dataclasses.replace(r, name=name, run_dir=run_dir)


def with_feature_ids(recipe: Recipe, num_layers: int) -> Recipe:
    """Fill `features.hidden_ids` from the drafter (when empty) or check it holds what the drafter needs."""
    if not recipe.drafter.kind:
        if not recipe.features.hidden_ids:
            raise ConfigError("features.hidden_ids is empty and no drafter.kind is set: name the drafter "
                              "(drafter.kind=eagle3|eagle1|medusa|layerskip) or list the hidden-state ids "
                              "(0 = embeddings, i = layer i output, L = final normed state), e.g. features.hidden_ids=[2,3,5]")
        return recipe
    need = sorted(recipe.drafter.selected().feature_ids(num_layers))
    have = list(recipe.features.hidden_ids)
    if not have:
        return dataclasses.replace(recipe, features=dataclasses.replace(recipe.features, hidden_ids=need))
    missing = sorted(set(need) - set(have))
    if missing:
        raise ConfigError(f"features.hidden_ids {have} lacks {missing}, which a {recipe.drafter.kind} drafter needs "
                          f"for a {num_layers}-layer target; remove the key to use {need}")
    return recipe


def load_config(cls: type, yaml_path: str | Path | None, overrides: Sequence[str] = ()) -> Any:
    """Build dataclass `cls` from a YAML mapping and dotted `a.b=value` overrides (values parsed as YAML)."""
    where = str(yaml_path) if yaml_path is not None else "<defaults>"
    raw: dict[str, Any] = {}
    if yaml_path is not None:
        p = Path(yaml_path)
        if not p.is_file():
            raise ConfigError(f"recipe file not found: {p}")
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {e}") from e
        if not isinstance(raw, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of keys, got {type(raw).__name__}")
    for ov in overrides:
        key, eq, text = ov.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"override {ov!r} must look like key=value (dotted keys for nested fields)")
        try:
            value = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError:
            value = text
        _set_dotted(raw, key.strip().split("."), value, cls, f"override {ov!r}")
    return build(cls, raw, "", where)


def _set_dotted(raw: dict, keys: list[str], value: Any, cls: type, where: str) -> None:
    """Write raw[k1][k2]... = value, checking each key against the schema on the way down."""
    node, schema = raw, cls
    for i, k in enumerate(keys):
        if schema is not None and dataclasses.is_dataclass(schema):
            names = {f.name: f for f in dataclasses.fields(schema)}
            if k not in names:
                raise ConfigError(_unknown(".".join(keys[: i + 1]), k, list(names), where))
            schema = _dataclass_in(typing.get_type_hints(schema)[k])
        else:
            schema = None  # inside a free-form dict: anything goes
        if i == len(keys) - 1:
            node[k] = value
        else:
            if not isinstance(node.get(k), dict):
                node[k] = {}
            node = node[k]


def build(cls: type, raw: Any, prefix: str, where: str):
    """Recursively convert a YAML mapping into dataclass `cls`, rejecting unknown/missing keys."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: '{prefix or cls.__name__}' must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for k in raw:
        if k not in fields:
            raise ConfigError(_unknown(prefix + str(k), str(k), list(fields), where))
    kwargs = {}
    for name, f in fields.items():
        dotted = prefix + name
        if name not in raw:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{where}: missing required key '{dotted}'")
            continue
        kwargs[name] = convert(raw[name], hints[name], dotted, where)
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:  # __post_init__ validation
        raise ConfigError(f"{where}: {prefix.rstrip('.') or cls.__name__}: {e}") from e


def convert(value: Any, tp: Any, dotted: str, where: str) -> Any:
    """Check `value` against type `tp` (converting int -> float and nested mappings -> dataclasses)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    bad = ConfigError(f"{where}: '{dotted}' should be {_type_name(tp)}, got {value!r}")
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return build(tp, value, dotted + ".", where)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return convert(value, a, dotted, where)
            except ConfigError:
                pass
        raise bad
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where}: '{dotted}' must be one of {list(args)}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise bad
        return [convert(v, args[0] if args else Any, f"{dotted}[{i}]", where) for i, v in enumerate(value)]
    if origin is tuple:  # tuple[X, ...] fields take a YAML list
        if not isinstance(value, (list, tuple)):
            raise bad
        elem = args[0] if args else Any
        return tuple(convert(v, elem, f"{dotted}[{i}]", where) for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise bad
        return dict(value)
    if tp is float:
        if isinstance(value, str):  # PyYAML reads 1e-3 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                raise bad from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise bad
        return value
    if tp is str:
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise bad
        return str(value)  # `name: 123` is a fine name
    raise ConfigError(f"{where}: '{dotted}': unsupported config type {tp!r}")


def to_dict(cfg: Any) -> dict[str, Any]:
    """A plain nested dict (for writing the resolved config next to a run)."""
    return dataclasses.asdict(cfg)


def dump_config(cfg: Any, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def _unknown(dotted: str, key: str, valid: list[str], where: str) -> str:
    near = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    parent = dotted.rsplit(".", 1)[0] + "." if "." in dotted else ""
    hint = f"; did you mean '{parent}{near[0]}'?" if near else f"; valid keys here: {', '.join(sorted(valid))}"
    return f"{where}: unknown key '{dotted}'{hint}"


def _dataclass_in(tp: Any) -> type | None:
    """The dataclass inside `tp` (X or X | None), else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    for a in typing.get_args(tp):
        if dataclasses.is_dataclass(a):
            return a
    return None


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")
