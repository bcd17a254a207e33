"""Recipe config loading: defaults, dotted overrides, unknown keys with suggestions, type errors."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from train.config import ConfigError, Recipe, load_config, load_recipe

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Inner:
    """A nested test config."""

    x: int = 1  # a number
    names: list[str] = field(default_factory=list)  # names


@dataclass
class Outer:
    """A test config tree (load_config is generic)."""

    inner: Inner = field(default_factory=Inner)  # nested
    flag: bool = False  # a switch
    opt: int | None = None  # optional


def write(tmp_path: Path, text: str, name: str = "my_recipe.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_defaults_and_path_defaults(tmp_path):
    r = load_recipe(write(tmp_path, "target: some/model\n"))
    assert isinstance(r, Recipe) and r.target == "some/model"
    assert r.name == "my_recipe" and r.run_dir == "runs/my_recipe"
    assert r.features.cache_dir == "" and r.data.regenerate.out_dir == ""  # keyed dirs under the data home
    assert r.drafter.kind == "" and r.train.steps == 1000


def test_typed_drafter_and_train_sections(tmp_path):
    r = load_recipe(
        write(tmp_path, "target: t\ndrafter:\n  kind: medusa\n  medusa:\n    num_heads: 3\n"),
        ["train.lr=1e-3", "drafter.layerskip.exits=[1, 2]"],
    )
    assert r.drafter.selected().num_heads == 3 and r.train.lr == 1e-3 and r.drafter.layerskip.exits == (1, 2)
    with pytest.raises(ConfigError, match="did you mean 'drafter.medusa.num_heads'"):
        load_recipe(write(tmp_path, "target: t\n"), ["drafter.medusa.num_head=3"])
    with pytest.raises(ConfigError, match=r"'drafter.kind': Invalid value 'hydra', expected one of \['', 'eagle3'"):
        load_recipe(write(tmp_path, "target: t\n"), ["drafter.kind=hydra"])


def test_overrides_nested_lists_and_typed_sections(tmp_path):
    p = write(tmp_path, "target: m\ndata:\n  max_length: 64\nfeatures:\n  hidden_ids: [1]\n")
    r = load_recipe(
        p,
        [
            "data.max_length=128",
            "features.hidden_ids=[2, 3]",
            "data.held_out=0",
            "drafter.kind=eagle3",
            "drafter.eagle3.ttt_steps=4",
            "run_dir=/tmp/x",
            "data.source=a.jsonl",
        ],
    )
    assert r.data.max_length == 128 and r.features.hidden_ids == [2, 3]
    assert r.data.held_out == 0.0 and isinstance(r.data.held_out, float)  # int -> float
    assert r.drafter.kind == "eagle3" and r.drafter.eagle3.ttt_steps == 4
    assert r.run_dir == "/tmp/x" and r.features.cache_dir == ""
    assert r.data.sources == ["a.jsonl"]


def test_unknown_keys_suggest_the_nearest(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key 'data.max_lenght'; did you mean 'data.max_length'\?"):
        load_recipe(write(tmp_path, "target: m\ndata:\n  max_lenght: 3\n"))
    with pytest.raises(ConfigError, match=r"override 'features.hiden_ids=\[1\]'.*did you mean 'features.hidden_ids'"):
        load_recipe(write(tmp_path, "target: m\n"), ["features.hiden_ids=[1]"])
    with pytest.raises(ConfigError, match="did you mean 'target'"):
        load_recipe(write(tmp_path, "targt: m\n"))


def test_type_and_value_errors(tmp_path):
    p = write(tmp_path, "target: m\n")
    with pytest.raises(
        ConfigError, match="'data.max_length': Value 'long' of type 'str' could not be converted to Int"
    ):
        load_recipe(p, ["data.max_length=long"])
    with pytest.raises(
        ConfigError, match=r"'features.mode': Invalid value 'sometimes', expected one of \['offline', 'onl"
    ):
        load_recipe(p, ["features.mode=sometimes"])
    with pytest.raises(
        ConfigError, match=r"'features.hidden_ids\[1\]': Value 'x' .* could not be converted to Integer"
    ):
        load_recipe(p, ["features.hidden_ids=[1, x]"])
    with pytest.raises(ConfigError, match=r"data.held_out=1.5: must be in \[0, 1\)"):
        load_recipe(p, ["data.held_out=1.5"])
    with pytest.raises(ConfigError, match="must look like key=value"):
        load_recipe(p, ["data.max_length"])
    with pytest.raises(ConfigError, match="missing required key 'target'"):
        load_recipe(write(tmp_path, "seed: 1\n"))
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_recipe(write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigError, match="not found"):
        load_recipe(tmp_path / "nope.yaml")


def test_yaml_floats_empty_values_tuples_and_retargeting(tmp_path):
    p = write(tmp_path, "target: a\ntrain:\n  lr: 1e-3\n  min_lr_ratio: 0\ndata:\n  source: x.jsonl\n")
    r = load_recipe(p, ["target=/models/b", "data.source=", "drafter.eagle3.capture_ids=[1, 3]"])
    assert r.train.lr == 1e-3 and isinstance(r.train.lr, float) and isinstance(r.train.min_lr_ratio, float)
    assert r.target == "/models/b" and r.data.source == "" and r.data.sources == []  # key= is "", not null
    assert r.drafter.eagle3.capture_ids == (1, 3)
    with pytest.raises(ConfigError, match=r"override 'drafter.layerskip.exits=\[1, x\]'"):
        load_recipe(p, ["drafter.layerskip.exits=[1, x]"])
    with pytest.raises(
        ConfigError, match="'data.source': .* incompatible with type hint"
    ):  # str | list[str], not a mapping
        load_recipe(p, ["data.source={a: 1}"])
    assert load_recipe(write(tmp_path, "target: m\nname: ${target}-run\n")).name == "m-run"  # OmegaConf interpolation
    with pytest.raises(ConfigError, match=r"'name': Interpolation key 'nope' not found$"):
        load_recipe(write(tmp_path, "target: m\nname: ${nope}\n"))


def test_generic_loader_on_any_dataclass():
    c = load_config(Outer, None, ["inner.x=5", "flag=true", "inner.names=[a, b]", "opt=null"])
    assert c == Outer(Inner(5, ["a", "b"]), True, None)
    with pytest.raises(ConfigError, match="'flag': Value 'maybe' is not a valid bool"):
        load_config(Outer, None, ["flag=maybe"])


def test_every_recipe_in_the_repo_loads():
    for p in sorted((REPO / "recipes").rglob("*.yaml")):
        if "accelerate" in p.parts:
            continue  # accelerate's own config files, not recipes
        r = load_recipe(p)
        assert r.target


def test_smollm2_recipes_fit_the_real_target_and_share_their_data():
    """The six chat recipes: valid for SmolLM2-135M's 30 layers / 49,152 tokens, one shared regen + feature cache."""
    import json

    from train.config import with_feature_ids

    cfg = json.loads((REPO / "tests/data/smollm2-135m-config.json").read_text())
    L, V = cfg["num_hidden_layers"], cfg["vocab_size"]
    recipes = {
        k: load_recipe(REPO / f"recipes/smollm2-135m/{k}.yaml")
        for k in ("eagle3", "eagle1", "medusa", "layerskip", "dflash", "dspark")
    }
    for kind, r in recipes.items():
        text = (REPO / f"recipes/smollm2-135m/{kind}.yaml").read_text()
        assert f"accelerate launch -m train recipes/smollm2-135m/{kind}.yaml" in text and "GPU-sized run" in text
        assert r.target == "recipes/targets/smollm2-135m-instruct" and r.drafter.kind == kind
        assert r.data.sources == ["fetch:sharegpt-first-turns"] and r.data.regenerate.enabled
        assert r.features.mode == "offline"
        with_feature_ids(r, L)  # the shared hidden ids hold what this drafter needs
        r.drafter.selected().resolved(L, V)  # capture ids / exits in range for 30 layers
        # identical data and feature sections: the first recipe run pays for regeneration and extraction
        assert (r.seed, r.data, r.features) == (
            recipes["eagle3"].seed,
            recipes["eagle3"].data,
            recipes["eagle3"].features,
        )
    ls = recipes["layerskip"].drafter.layerskip.resolved(L, V)
    assert (ls.mode, ls.exits, ls.draft_exit) == ("full", (8,), 8)
    assert recipes["eagle3"].drafter.eagle3.draft_vocab_size < V


def schema_leaves(cls: type = Recipe, prefix: str = "") -> dict[str, object]:
    """Every leaf setting of a dataclass tree: dotted key -> its type hint."""
    import dataclasses
    import typing

    out: dict[str, object] = {}
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(hint):
            out.update(schema_leaves(hint, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = hint
    return out


def test_every_literal_setting_takes_each_of_its_words_in_yaml_and_overrides(tmp_path):
    """`no`, `off`, `yes`, `on` are YAML 1.1 booleans: a Literal or string setting must still get the word,
    from a recipe file and from an override alike (train.mixed_precision=no was refused as 'False')."""
    import typing

    literals = {k: typing.get_args(h) for k, h in schema_leaves().items() if typing.get_origin(h) is typing.Literal}
    assert "train.mixed_precision" in literals and "features.mode" in literals
    for key, words in literals.items():
        for word in words:
            if word == "" or (key == "drafter.kind" and word):
                continue  # drafter.kind's words are checked by the recipes that use them
            *parents, leaf = key.split(".")
            yaml_text = (
                "target: m\n"
                + "".join(f"{'  ' * i}{p}:\n" for i, p in enumerate(parents))
                + f"{'  ' * len(parents)}{leaf}: {word}\n"
            )
            from_file = load_recipe(write(tmp_path, yaml_text))
            from_override = load_recipe(write(tmp_path, "target: m\n"), [f"{key}={word}"])
            for r in (from_file, from_override):
                value = r
                for part in key.split("."):
                    value = getattr(value, part)
                assert value == word, (key, word, value)


def test_yes_no_on_off_words_keep_their_meaning_per_type(tmp_path):
    p = write(
        tmp_path,
        "target: m\nname: no\ndata:\n  split: off\n  chat_template: no\ntrain:\n  mixed_precision: no\n"
        "  eval_only: on\n  steps: 0\n",
    )
    r = load_recipe(p)
    assert (r.name, r.data.split, r.data.chat_template, r.train.mixed_precision, r.train.eval_only) == (
        "no",
        "off",
        False,
        "no",
        True,
    )
    r = load_recipe(
        write(tmp_path, "target: m\n"),
        ["name=yes", "data.split=on", "data.chat_template=off", "train.mixed_precision=no", "train.report_to=none"],
    )
    assert (r.name, r.data.split, r.data.chat_template, r.train.mixed_precision) == ("yes", "on", False, "no")
    with pytest.raises(
        ConfigError,
        match=r"'train.mixed_precision': Invalid value 'off', expected one of .*; set "
        r"train.mixed_precision to one of them",
    ):
        load_recipe(write(tmp_path, "target: m\n"), ["train.mixed_precision=off"])


def test_every_numeric_and_word_setting_has_a_range():
    """A new int/float/list setting without an entry in train/settings.py CHECKS fails here, so no
    setting goes unchecked; a CHECKS key the schema lacks is stale."""
    import typing

    from train.settings import CHECKS, FREE_TEXT

    leaves = schema_leaves()
    assert set(CHECKS) <= set(leaves), sorted(set(CHECKS) - set(leaves))
    unchecked = [
        k
        for k, h in leaves.items()
        if k not in CHECKS
        and k not in FREE_TEXT
        and typing.get_origin(h) is not typing.Literal
        and h is not bool
        and h != bool | None
    ]
    assert unchecked == []


def test_a_section_the_drafter_never_reads_is_warned_about(tmp_path, capsys):
    p = write(tmp_path, "target: m\ndrafter:\n  kind: medusa\n  eagle1:\n    ce_weight: 0.2\n")
    load_recipe(p, ["drafter.eagle3.ttt_steps=2", "drafter.medusa.num_heads=2"])
    warnings = [x for x in capsys.readouterr().err.splitlines() if x.startswith("warning:")]
    assert len(warnings) == 2 and all("drafter.kind is 'medusa'" in w for w in warnings)
    assert "drafter.eagle1.ce_weight" in warnings[0] and "drafter.eagle3.ttt_steps" in warnings[1]


def test_the_lk_loss_keys_round_trip_and_are_checked(tmp_path):
    """train.loss / lk_variant / lk_eta / lk_kl_scale: defaults, a dumped config that loads back the same, and
    each refused with its range; lk with a drafter trained on token labels is refused before any work."""
    from drafters.trainable.lk import Objective
    from train.config import dump_config

    p = write(tmp_path, "target: m\ndrafter:\n  kind: eagle3\n")
    r = load_recipe(p)
    assert (r.train.loss, r.train.lk_variant, r.train.lk_eta, r.train.lk_kl_scale) == ("kl", "lambda", 3.0, 1.0)
    r = load_recipe(p, ["train.loss=lk", "train.lk_variant=alpha", "train.lk_eta=2", "train.lk_kl_scale=0.5"])
    assert Objective.of(r.train) == Objective("lk", "alpha", 2.0, 0.5)
    dump_config(r, tmp_path / "run" / "config.yaml")
    assert load_recipe(tmp_path / "run" / "config.yaml").train == r.train
    with pytest.raises(ConfigError, match=r"'train.loss': Invalid value 'foo', expected one of \['kl', 'lk'\]"):
        load_recipe(p, ["train.loss=foo"])
    with pytest.raises(ConfigError, match=r"'train.lk_variant': Invalid value 'tv'"):
        load_recipe(p, ["train.lk_variant=tv"])
    with pytest.raises(ConfigError, match=r"train.lk_eta=-1.0: must be a number >= 0.0"):
        load_recipe(p, ["train.lk_eta=-1"])
    with pytest.raises(ConfigError, match=r"train.lk_kl_scale=1.5: must be in \[0, 1\]"):
        load_recipe(p, ["train.lk_kl_scale=1.5"])
    with pytest.raises(ConfigError, match=r"override 'train.loss=lk': .*drafter.medusa.loss=ce trains on token labels"):
        load_recipe(p, ["drafter.kind=medusa", "train.loss=lk"])
    assert load_recipe(p, ["drafter.kind=medusa", "drafter.medusa.loss=kl", "train.loss=lk"]).train.loss == "lk"
