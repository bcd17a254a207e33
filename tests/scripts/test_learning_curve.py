"""scripts/learning_curve.py's ablation labels: a run is named by the settings it changes against the base."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def lc():
    spec = importlib.util.spec_from_file_location("_learning_curve", REPO / "scripts/learning_curve.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_lever_names_what_a_run_changes_and_skips_bookkeeping(lc):
    base = {
        "run_dir": "runs/a",
        "train": {"steps": 300, "threads": 1, "save_every": 300, "sim_eval_prompts": 8},
        "drafter": {"eagle3": {"noise": "gaussian", "ttt_steps": 3}},
    }
    run = {
        "run_dir": "runs/b",
        "train": {"steps": 300, "threads": 2, "save_every": 100, "sim_eval_prompts": 0},
        "drafter": {"eagle3": {"noise": "none", "ttt_steps": 5}},
    }
    assert lc.lever(run, base) == "drafter.eagle3.noise=none, drafter.eagle3.ttt_steps=5"
    assert lc.lever(base, base) == "(base)"
    # a key only one side has is a change too (a newer config key, say)
    assert lc.lever({**base, "extra": {"x": 1}}, base) == "extra.x=1"
    # ... unless it holds the schema's default: a base run written before train.max_sequences existed ran at 0
    with_key = {**base, "train": {**base["train"], "max_sequences": 0}}
    assert lc.lever(with_key, base) == lc.lever(base, with_key) == "(base)"
    assert lc.lever({**base, "train": {**base["train"], "max_sequences": 124}}, base) == "train.max_sequences=124"


def test_lever_names_another_drafter_kind_once(lc):
    """An EAGLE-1 run against an EAGLE-3 base: the kind is the change, not every key of both kinds' sections."""
    base = {
        "name": "eagle3",
        "train": {"steps": 300, "optimizer": "muon"},
        "drafter": {"kind": "eagle3", "eagle3": {"ttt_steps": 3}, "eagle1": None},
    }
    run = {
        "name": "eagle1",
        "train": {"steps": 300, "optimizer": "adamw"},
        "drafter": {"kind": "eagle1", "eagle3": None, "eagle1": {"ce_weight": 0.1}},
    }
    assert lc.lever(run, base) == "drafter.kind=eagle1 (its drafter.eagle1 section), train.optimizer=adamw"


def test_table_gets_a_changes_column_only_with_levers(lc, tmp_path):
    point = {
        "run": "r",
        "step": 4,
        "trained_tokens": 10,
        "shapes": {"chain-8": {"tau": 1.5, "by_depth": [0.4, 0.1, 0.0]}, "tree": {"tau": 2.0, "by_depth": [0.6]}},
    }
    plain = lc.write_table([point], ["chain-8", "tree"], tmp_path / "a.md").splitlines()
    labelled = lc.write_table([{**point, "lever": "x=1"}], ["chain-8", "tree"], tmp_path / "b.md").splitlines()
    assert "changes" not in plain[0] and "| r | x=1 | 4 | 10 | 1.500 | 2.000 |" in labelled[2]
    for table in (plain, labelled):  # every row has the header's number of cells
        assert len({line.count("|") for line in table}) == 1, table


def test_lever_plot_is_written(lc, tmp_path):
    def point(run, lever, tau, per_prompt=None):
        return {
            "run": run,
            "step": 4,
            "lever": lever,
            "shapes": {"tree": {"tau": tau, "by_depth": [0.5], **({"per_prompt": per_prompt} if per_prompt else {})}},
        }

    # with per-prompt τ (whiskers: the paired SE), and a run without them (an older point: no whisker)
    lc.plot_levers(
        [point("b", "(base)", 1.8, [1.7, 1.9]), point("n", "x=1", 1.7, [1.5, 1.9]), point("o", "y=2", 1.6)],
        ["tree"],
        tmp_path / "levers.png",
    )
    assert (tmp_path / "levers.png").stat().st_size > 1000


def test_paired_delta_against_the_base_run(lc, tmp_path):
    def point(run, lever, taus):
        return {
            "run": run,
            "step": 4,
            "lever": lever,
            "shapes": {"tree": {"tau": sum(taus) / len(taus), "by_depth": [0.5], "per_prompt": taus}},
        }

    base, run = point("b", "(base)", [1.0, 2.0, 3.0]), point("n", "x=1", [1.1, 2.3, 3.2])
    mean, se = lc.paired_delta([1.1, 2.3, 3.2], [1.0, 2.0, 3.0])
    assert abs(mean - 0.2) < 1e-12 and abs(se - 0.1 / 3**0.5) < 1e-12  # diffs 0.1, 0.3, 0.2: std 0.1
    table = lc.write_table([base, run], ["tree"], tmp_path / "t.md").splitlines()
    assert table[2].endswith("| - |") and table[3].endswith("| tree +0.200 ± 0.058 |"), table
    assert len({line.count("|") for line in table}) == 1, table
    # a point at another step than the base's is compared with the base's step, and says which
    early = {**point("n", "x=1", [1.1, 2.3, 3.2]), "step": 2}
    table = lc.write_table([base, early], ["tree"], tmp_path / "t.md").splitlines()
    assert table[3].endswith("| tree +0.200 ± 0.058 (vs its step 4) |"), table


def test_reference_points_serve_as_the_base_of_a_later_ablation(lc, tmp_path):
    base_cfg = {"run_dir": "runs/a", "drafter": {"eagle3": {"ttt_steps": 3}}}
    ref = tmp_path / "old.points.jsonl"
    ref.write_text(
        json.dumps(
            {
                "run": "a",
                "step": 4,
                "config": base_cfg,
                "shapes": {"tree": {"tau": 1.5, "by_depth": [0.5], "per_prompt": [1.0, 2.0]}},
            }
        )
        + "\n"
    )
    (points,) = lc.read_references([str(ref)])
    assert points["reference"] == str(ref)
    assert lc.base_config("a", [points]) == base_cfg  # a name: the reference run's stored config
    run_dir = tmp_path / "runs/b"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("run_dir: runs/b\ndrafter:\n  eagle3:\n    ttt_steps: 5\n")
    assert lc.base_config(str(run_dir), [points])["drafter"]["eagle3"]["ttt_steps"] == 5  # a directory: its yaml
    for bad in ("nope", str(tmp_path / "missing")):
        with pytest.raises(SystemExit, match="--base|config.yaml"):
            lc.base_config(bad, [points])
    with pytest.raises(SystemExit, match="no such file"):
        lc.read_references([str(tmp_path / "none.jsonl")])
    new = {
        "run": "b",
        "step": 4,
        "lever": lc.lever({"run_dir": "runs/b", "drafter": {"eagle3": {"ttt_steps": 5}}}, base_cfg),
        "shapes": {"tree": {"tau": 1.75, "by_depth": [0.5], "per_prompt": [1.5, 2.0]}},
    }
    table = lc.write_table([{**points, "lever": "(base)"}, new], ["tree"], tmp_path / "t.md").splitlines()
    assert table[2].startswith("| a (from old.points.jsonl) | (base) |"), table
    assert table[3].startswith("| b | drafter.eagle3.ttt_steps=5 |") and "tree +0.250 ± 0.250" in table[3], table


def test_seed_table_pools_seeds_and_reads_deltas_against_the_seed_spread(lc):
    from scripts import curve_points as cp  # importable once the script put the checkout on sys.path

    def point(run, lever, tau, step=4):
        return {"run": run, "step": step, "lever": lever, "shapes": {"tree": {"tau": tau, "by_depth": [0.5]}}}

    points = [
        point("base", "(base)", 2.00),
        point("base-s1", "seed=1", 2.10),
        point("lk", "train.loss=lk", 2.30),
        point("lk-s1", "seed=1, train.loss=lk", 2.26),
        point("lk-s1", "seed=1, train.loss=lk", 1.00, step=2),  # an earlier point of a run: not its last
        point("norms", "drafter.eagle3.fc_norm=True", 2.12),
        point("norms-s1", "drafter.eagle3.fc_norm=True, seed=1", 2.02),
        point("ids", "drafter.eagle3.capture_ids=[2, 4, 8, 15, 27]", 1.9),
    ]
    assert cp.without_seed("seed=1") == "(base)" and cp.without_seed("seed=1, train.loss=lk") == "train.loss=lk"
    rows = {line.split(" | ")[0].lstrip("| "): line for line in cp.seed_table(points, ["tree"]).splitlines()[2:]}
    assert "2.050 (2.000–2.100)" in rows["(base)"] and "| 2 |" in rows["(base)"]
    assert "2.280 (2.260–2.300) | +0.230, gain beyond the seed spread (0.100)" in rows["train.loss=lk"]
    assert "+0.020, inside the seed spread (0.100)" in rows["drafter.eagle3.fc_norm=True"]
    assert "one seed: no spread" in rows["drafter.eagle3.capture_ids=[2, 4, 8, 15, 27]"]
    assert cp.seed_table([point("base", "(base)", 2.0), point("lk", "train.loss=lk", 2.3)], ["tree"]) == ""


def test_seed_pairs_pair_each_run_with_the_base_of_its_own_seed(lc):
    """A seed changes the data too: each lever run is paired, prompt by prompt, with the base run of its seed."""
    from scripts import curve_points as cp

    def point(run, lever, seed, per_prompt):
        shapes = {"tree": {"tau": sum(per_prompt) / 3, "by_depth": [0.5], "per_prompt": per_prompt}}
        return {"run": run, "step": 4, "lever": lever, "config": {"seed": seed}, "shapes": shapes}

    points = [
        point("base", "(base)", 0, [2.0, 2.0, 2.0]),
        point("base-s1", "seed=1", 1, [3.0, 3.0, 3.0]),
        point("lk", "train.loss=lk", 0, [2.1, 2.2, 2.3]),
        point("lk-s1", "seed=1, train.loss=lk", 1, [3.1, 3.2, 3.3]),
        point("ids", "drafter.eagle3.capture_ids=[1, 2]", 2, [9.0, 9.0, 9.0]),  # no base at seed 2: not paired
    ]
    pairs = cp.seed_pairs(points, ["tree"])
    assert list(pairs) == ["train.loss=lk"]
    (s0, d0, se0), (s1, d1, se1) = pairs["train.loss=lk"]["tree"]
    assert (s0, s1) == (0, 1) and abs(d0 - 0.2) < 1e-9 and abs(d1 - 0.2) < 1e-9  # not 3.2 - 2.0 across seeds
    assert abs(se0 - 0.1 / 3**0.5) < 1e-9
    row = next(line for line in cp.seed_table(points, ["tree"]).splitlines() if line.startswith("| train.loss=lk"))
    assert row.endswith("| tree: s0 +0.200 ± 0.058, s1 +0.200 ± 0.058 |")


def test_references_alone_are_tabulated_again_without_a_model(lc, tmp_path):
    """No run directories: the --reference points are relabelled against --base and tabulated (seeds pooled)."""

    def point(run, seed, tau):
        cfg = {"seed": seed, "drafter": {"eagle3": {"fc_norm": run.startswith("n")}}}
        return {"run": run, "step": 4, "config": cfg, "shapes": {"tree": {"tau": tau, "by_depth": [0.5, 0.2]}}}

    ref = tmp_path / "old.points.jsonl"
    rows = [point("b", 0, 1.8), point("b1", 1, 1.84), point("n", 0, 1.9), point("n1", 1, 1.95)]
    ref.write_text("".join(json.dumps(p) + "\n" for p in rows))
    out = tmp_path / "out"
    assert lc.main(["--reference", str(ref), "--base", "b", "--chains", "", "--out", str(out)]) == 0
    seeds = (out / "seeds.md").read_text()
    assert "| drafter.eagle3.fc_norm=True | 2 | 1.925 (1.900–1.950) | +0.105, gain beyond the seed spread" in seeds
    assert (out / "curve.md").exists() and not (out / "points.jsonl").exists()
    with pytest.raises(SystemExit):
        lc.main(["--out", str(out)])
