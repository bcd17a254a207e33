"""An `eagle3` directory that leaves out the engines' default capture ids (DESIGN §5) loads without a warning
when our own export records that it did so; a foreign directory naming no ids, or an export whose record
disagrees with the default, still says so."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from decode.target import Target
from drafters.serving.checkpoint import save_drafter
from drafters.serving.engine_dirs import load_eagle3
from drafters.serving.export import export
from drafters.serving.layouts.rules import capture_ids_hf, engine_default_ids, unnamed_ids_warning
from tests.conftest import REPO, tiny_model
from tests.drafters.batches import build

SHIPPED = REPO / "recipes" / "smollm2-135m" / "drafters" / "eagle3"


@pytest.fixture(scope="module")
def deep_target_dir(tmp_path_factory) -> Path:
    """8 layers: the engines' default ids (2, 4, 5) are also the drafter's default, so the export omits them."""
    out = tmp_path_factory.mktemp("target8")
    tiny_model("qwen3", seed=3, layers=8).save_pretrained(out)
    return out


def load_quietly(path: Path, target: Target, capsys) -> tuple[object, str]:
    """(the module, everything said on stderr or as a Python warning while loading it)."""
    capsys.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = load_eagle3(path, target)
    return module, capsys.readouterr().err + "".join(str(w.message) for w in caught)


def rewrite(path: Path, edit) -> None:
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def test_own_export_of_default_ids_loads_silently(tmp_path, deep_target_dir, capsys):
    target = Target.load(deep_target_dir)
    module = build("eagle3", target)
    assert module.config.capture_ids == tuple(engine_default_ids(8)) == (2, 4, 5)
    save_drafter(module, tmp_path / "run" / "export", target_id=str(deep_target_dir))
    out = export(tmp_path / "run", "eagle3", tmp_path / "e3")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["eagle_config"] == {"use_aux_hidden_state": True}  # the engines' default: left out
    assert cfg["draftsmith"]["exported_by"] == "draftsmith" and cfg["draftsmith"]["capture_ids_hf"] == [2, 4, 5]
    loaded, said = load_quietly(out, target, capsys)
    assert said == "" and loaded.config.capture_ids == (2, 4, 5)

    rewrite(out, lambda c: c.pop("draftsmith"))  # a foreign directory: nobody says which layers it was trained on
    loaded, said = load_quietly(out, target, capsys)
    assert "warning: the config names no capture ids; using the engines' default HF ids [2, 4, 5]" in said
    assert loaded.config.capture_ids == (2, 4, 5)

    rewrite(out, lambda c: c.update(draftsmith={"exported_by": "draftsmith", "capture_ids_hf": [1, 4, 5]}))
    _, said = load_quietly(out, target, capsys)  # a record the config contradicts: a damaged export
    assert "its draftsmith export block records [1, 4, 5]: re-export the drafter" in said


def test_shipped_drafter_records_its_default_ids():
    """The shipped config leaves the ids out (both engines read the default right) and records them: silent."""
    cfg = json.loads((SHIPPED / "config.json").read_text())
    ids, explicit = capture_ids_hf("eagle3", cfg, 30)  # SmolLM2-135M: 30 layers
    assert (ids, explicit) == ([2, 15, 27], False) and cfg["draftsmith"]["capture_ids_hf"] == ids
    assert unnamed_ids_warning(cfg, ids, explicit) is None
