"""`python -m decode.evaluate` on a tiny run of the bundled target: report schema and values, plots, cost model.

One CLI run (the module's `run`) serves most tests; the sampled run at the end shows what a report says
when there is no greedy reference to match.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from decode.harness.evaluate import evaluate, main, prepare
from decode.harness.labels import label_of
from decode.harness.plots import PLOTS
from decode.harness.prompts import load_prompts
from decode.harness.report import cost_model
from decode.harness.runs import EvalConfig
from decode.sampling import SamplingConfig
from tests.conftest import STORIES
from tests.decode.harness.eval_prompts import prompt_file

DESIGN_KEYS = {
    "name",
    "mean_accepted_tokens",
    "acceptance_by_depth",
    "target_forward_passes",
    "new_tokens",
    "wall_time_s",
    "tokens_per_s",
    "speedup_vs_ar",
    "matches_ar",
    "prompts",
}
SUMMED = ("prompts", "new_tokens", "target_forward_passes", "drafter_forward_passes")
SPECS = ["early-exit:2", "skip:2", "hf-assisted:early-exit:2", "hf-generate"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One CLI run: AR + two of our drafters + two HF peers on 3 conversations (4 turns), 12 new tokens."""
    tmp = tmp_path_factory.mktemp("eval")
    out = tmp / "out"
    argv = [
        "--target",
        str(STORIES),
        "--prompts",
        str(prompt_file(tmp)),
        "--max-new-tokens",
        "12",
        "--draft-len",
        "4",
        "--target-pass-s",
        "20",
        "0.025",
        "--threads",
        "1",
        "--out",
        str(out),
    ]
    for spec in SPECS:
        argv += ["--drafter", spec]
    threads = torch.get_num_threads()
    try:  # one thread: a 260K-parameter model only loses from intra-op threads on a busy machine
        assert main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    return out, json.loads((out / "report.json").read_text())


def by_name(report):
    return {d["name"]: d for d in report["drafters"]}


def test_report_schema_and_ar_reference(run):
    _, report = run
    ds = by_name(report)
    assert list(ds) == ["ar", *SPECS]  # AR runs first
    for d in ds.values():
        assert DESIGN_KEYS <= set(d), DESIGN_KEYS - set(d)
        assert d["new_tokens"] == 4 * 12  # no EOS within 12 tokens on these prompts
        assert len(d["prompts"]) == 4
        assert d["matches_ar"] is True, d["name"]  # greedy speculative decoding is lossless
    ar = ds["ar"]
    assert ar["mean_accepted_tokens"] == 1.0
    assert ar["target_forward_passes"] == ar["new_tokens"]
    assert ar["speedup_vs_ar"] == 1.0
    assert ar["acceptance_by_depth"] == []
    assert report["settings"]["max_new_tokens"] == 12 and report["settings"]["temperature"] == 0.0


def test_our_drafters_report_rounds_and_time_split(run):
    _, report = run
    d = by_name(report)["early-exit:2"]
    assert d["kind"] == "draftsmith" and d["drafter_forward_passes"] > 0
    assert 1.0 < d["mean_accepted_tokens"] == pytest.approx(d["new_tokens"] / d["target_forward_passes"])
    assert 1 <= len(d["acceptance_by_depth"]) <= 4
    assert sum(d["accepted_length_histogram"]) == d["rounds"] == d["target_forward_passes"] - 4  # 4 prefills
    split = d["time_split_s"]
    assert set(split) == {"prefill", "draft", "verify", "commit"} and all(v > 0 for v in split.values())
    assert sum(split.values()) <= d["wall_time_s"] + 1e-9


def test_hf_peers_count_tau_with_hooks(run):
    _, report = run
    ds = by_name(report)
    hf = ds["hf-generate"]
    assert hf["kind"] == "hf" and hf["mean_accepted_tokens"] == 1.0 and hf["drafter_forward_passes"] == 0
    assert hf["time_split_s"] is None and hf["cost_model"] is None
    # HF's early exit drafts the same greedy chain of first-2-layer tokens as ours, so the passes agree,
    # except that HF drafts before its prefill (its first pass verifies prompt + draft): up to one
    # pass fewer per prompt
    ours, theirs = ds["early-exit:2"], ds["hf-assisted:early-exit:2"]
    assert ours["target_forward_passes"] - 4 <= theirs["target_forward_passes"] <= ours["target_forward_passes"]
    assert theirs["drafter_forward_passes"] > 0


def test_per_category_and_per_prompt_rows_add_up(run):
    _, report = run
    for d in report["drafters"]:
        cats = d["per_category"]
        assert set(cats) == {"park", "home"}
        assert cats["park"]["prompts"] == 2 and cats["home"]["prompts"] == 2  # the 2-turn conversation: 2 rows
        total = {"prompts": len(d["prompts"]), **{k: d[k] for k in SUMMED[1:]}}
        for key in SUMMED:
            assert sum(c[key] for c in cats.values()) == total[key], (d["name"], key)
            if key != "prompts":
                assert sum(p[key] for p in d["prompts"]) == total[key], (d["name"], key)
        assert sum(c["wall_time_s"] for c in cats.values()) == pytest.approx(d["wall_time_s"])
        for c in cats.values():
            assert c["mean_accepted_tokens"] == pytest.approx(c["new_tokens"] / c["target_forward_passes"])
    rows = by_name(report)["ar"]["prompts"]
    assert [(r["id"], r["category"], r["turn"]) for r in rows] == [
        ("1", "park", 0),
        ("2", "home", 0),
        ("2", "home", 1),
        ("3", "park", 0),
    ]
    # turn 2's prompt holds turn 1, the model's 12-token answer and turn 2
    assert rows[2]["prompt_tokens"] > rows[1]["prompt_tokens"] + 12


def test_cost_model_in_report_matches_hand_computation(run):
    _, report = run
    ds = by_name(report)
    assert report["cost_model"]["target_pass_s"] == [20.0, 0.025]
    assert "(T + d) / tau" in report["cost_model"]["formula"]

    def overhead(d):
        s = d["time_split_s"]
        return (s["draft"] + s["commit"]) / d["target_forward_passes"]

    d_ar = overhead(ds["ar"])
    for name in ("ar", "early-exit:2", "skip:2"):
        d = ds[name]
        for row, T in zip(d["cost_model"], (20.0, 0.025)):
            per_token = (T + overhead(d)) / d["mean_accepted_tokens"]
            assert row["target_pass_s"] == T
            assert row["time_per_token_s"] == pytest.approx(per_token)
            assert row["speedup_vs_ar"] == pytest.approx((T + d_ar) / per_token)
    assert [r["speedup_vs_ar"] for r in ds["ar"]["cost_model"]] == pytest.approx([1.0, 1.0])


def test_cost_model_hand_numbers():
    rows = cost_model(tau=2.5, d=0.5, d_ar=0.1, pass_costs=[20.0, 0.025])
    assert rows[0]["time_per_token_s"] == pytest.approx(20.5 / 2.5)  # 8.2 s a token
    assert rows[0]["speedup_vs_ar"] == pytest.approx(20.1 / 8.2)  # ≈ 2.45: τ almost all of it
    assert rows[1]["time_per_token_s"] == pytest.approx(0.525 / 2.5)
    assert rows[1]["speedup_vs_ar"] == pytest.approx(0.125 / 0.21)  # drafting dominates: a slowdown
    assert math.isinf(cost_model(0.0, 0.0, 0.0, [1.0])[0]["time_per_token_s"])


def test_plots_and_markdown_written_atomically(run):
    out, report = run
    for name in PLOTS:
        data = (out / name).read_bytes()
        assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n", name
    md = (out / "report.md").read_text()
    for d in report["drafters"]:
        assert f"| {label_of(d)} | `{d['name']}` | {d['mean_accepted_tokens']:.3f} |" in md
    assert "## τ per category" in md and "| drafter | park | home |" in md
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temp files left


def test_sampling_run_has_no_matches_ar(stories):
    convs = load_prompts(STORIES.parents[1] / "prompts" / "stories_dev.txt", limit=1)
    cfg = EvalConfig(max_new_tokens=8, sampling=SamplingConfig(temperature=0.8, top_p=0.9), draft_len=3, warmup=False)
    report = evaluate(stories, prepare(stories, ["early-exit:3", "ar"], cfg), convs, cfg, progress=False)
    assert [d["name"] for d in report["drafters"]] == ["ar", "early-exit:3"]  # explicit ar deduplicated
    for d in report["drafters"]:
        assert d["matches_ar"] is None and all(p["matches_ar"] is None for p in d["prompts"])
        assert d["new_tokens"] == 8
    assert report["drafters"][0]["mean_accepted_tokens"] == 1.0
