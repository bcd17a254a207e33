"""`python -m decode.evaluate` on a tiny run of the bundled target: report schema and values, plots, cost model."""

from __future__ import annotations

import json
import math

import pytest
import torch

from decode.harness.evaluate import EvalConfig, evaluate, main, make_run, prepare, run_spec
from decode.generate import Generation
from decode.harness.labels import label_of
from decode.metrics import GenStats
from decode.harness.prompts import load_prompts
from decode.harness.report import PLOTS, cost_model
from decode.sampling import SamplingConfig
from decode.tree import parse_shape
from tests.conftest import STORIES

DESIGN_KEYS = {"name", "mean_accepted_tokens", "acceptance_by_depth", "target_forward_passes", "new_tokens",
               "wall_time_s", "tokens_per_s", "speedup_vs_ar", "matches_ar", "prompts"}
SUMMED = ("prompts", "new_tokens", "target_forward_passes", "drafter_forward_passes")
SPECS = ["early-exit:2", "skip:2", "hf-assisted:early-exit:2", "hf-generate"]


def prompt_file(tmp_path):
    rows = [{"question_id": 1, "category": "park", "turns": ["One day, a boy named Tim went to the park."]},
            {"question_id": 2, "category": "home", "turns": ["Sam had a red ball.", "Then his dog came."]},
            {"question_id": 3, "category": "park", "turns": ["The sun was shining and the birds were singing."]}]
    p = tmp_path / "prompts.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One CLI run: AR + two of our drafters + two HF peers on 3 conversations (4 turns), 12 new tokens."""
    tmp = tmp_path_factory.mktemp("eval")
    out = tmp / "out"
    argv = ["--target", str(STORIES), "--prompts", str(prompt_file(tmp)), "--max-new-tokens", "12",
            "--draft-len", "4", "--target-pass-s", "20", "0.025", "--threads", "1", "--out", str(out)]
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
        ("1", "park", 0), ("2", "home", 0), ("2", "home", 1), ("3", "park", 0)]
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


class EchoRunner:
    """Answers every turn with the same tokens and records the prompts it was given."""

    name, kind = "echo", "draftsmith"

    def __init__(self, tokens: list[int]) -> None:
        self.tokens, self.prompts = tokens, []

    def run(self, prompt_ids, max_new_tokens, sampling, seed) -> Generation:
        self.prompts.append(prompt_ids)
        return Generation(list(self.tokens), GenStats(new_tokens=len(self.tokens), target_passes=len(self.tokens)))


def test_multi_turn_prompts_carry_the_runs_own_answer(stories, tmp_path):
    tok = stories.tokenizer
    runner = EchoRunner(tok("the purple elephant", add_special_tokens=False).input_ids)
    convs = load_prompts(prompt_file(tmp_path))
    run = run_spec(runner, stories, convs, EvalConfig(warmup=False), progress=False)
    assert len(runner.prompts) == 4 and [t.turn for t in run.turns] == [0, 0, 1, 0]
    second = tok.decode(runner.prompts[2], skip_special_tokens=True)
    assert second == "Sam had a red ball.\nthe purple elephant\nThen his dog came."
    assert tok.decode(runner.prompts[1], skip_special_tokens=True) == "Sam had a red ball."


def test_unknown_spec_lists_valid_forms(stories):
    cfg = EvalConfig()
    with pytest.raises(ValueError) as e:
        make_run("medusa-ish:3", stories, cfg)
    for form in ("early-exit:K", "skip:i,j,...", "draft-model:DIR", "hf-assisted:early-exit:K", "hf-prompt-lookup"):
        assert form in str(e.value)
    with pytest.raises(ValueError, match="hf-assisted:draft-model:DIR"):
        make_run("hf-assisted:lookahead", stories, cfg)
    with pytest.raises(ValueError, match=r"1\.\.4"):
        make_run("hf-assisted:early-exit:5", stories, cfg)


def test_cli_bad_spec_fails_before_running(tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["--target", str(STORIES), "--prompts", str(prompt_file(tmp_path)), "--drafter", "early-exit:2",
               "--drafter", "bogus", "--out", str(out)])
    assert rc == 2 and not out.exists()
    assert "unknown drafter SPEC 'bogus'" in capsys.readouterr().err


def test_hf_prompt_lookup_peer_is_lossless(stories):
    ids = stories.tokenizer("Sam had a red ball. Sam had a red ball. Sam", return_tensors="pt").input_ids[0]
    peer = make_run("hf-prompt-lookup:ngram=2,k=4", stories, EvalConfig())
    ar = make_run("ar", stories, EvalConfig())
    got = peer.run(ids, 16, SamplingConfig(), 0)
    ref = ar.run(ids, 16, SamplingConfig(), 0)
    assert got.tokens == ref.tokens
    assert got.stats.target_passes < ref.stats.target_passes and got.stats.drafter_passes == 0


def test_draft_model_peers_match_early_exit(stories, tmp_path):
    """A separate draft model = the target's first 2 layers (saved truncated) drafts what early-exit:2 drafts."""
    from decode.target import load_model

    model = load_model(STORIES)
    model.model.layers = model.model.layers[:2]
    model.config.num_hidden_layers = 2
    model.save_pretrained(tmp_path)
    stories.tokenizer.save_pretrained(tmp_path)
    ids = stories.tokenizer("Sam had a red ball.", return_tensors="pt").input_ids[0]
    cfg, greedy = EvalConfig(draft_len=3), SamplingConfig()
    ref = make_run("early-exit:2", stories, cfg).run(ids, 16, greedy, 0)
    assert ref.tokens == make_run("ar", stories, cfg).run(ids, 16, greedy, 0).tokens
    for spec, saved in ((f"draft-model:{tmp_path}", 0), (f"hf-assisted:draft-model:{tmp_path}", 1)):
        got = make_run(spec, stories, cfg).run(ids, 16, greedy, 0)
        assert got.tokens == ref.tokens, spec
        # HF may save one pass: it drafts before its prefill
        assert ref.stats.target_passes - saved <= got.stats.target_passes <= ref.stats.target_passes, spec
        assert got.stats.drafter_passes > 0, spec


class SeedRunner(EchoRunner):
    """Records (runner name, seed, wall order) for every call."""

    def __init__(self, name: str, log: list) -> None:
        super().__init__([5, 6])
        self.name, self.log = name, log

    def run(self, prompt_ids, max_new_tokens, sampling, seed) -> Generation:
        self.log.append((self.name, seed))
        gen = super().run(prompt_ids, max_new_tokens, sampling, seed)
        gen.stats.wall_s = {"ar": 1.0, "a": 0.5, "b": 2.0}[self.name]  # a: twice AR's speed, b: half
        return gen


def test_timing_is_interleaved_by_conversation_with_sequential_seeds(stories, tmp_path):
    """Rows alternate conversation by conversation (rotated), each turn keeps seed + its global index."""
    log: list = []
    runners = [(n, SeedRunner(n, log)) for n in ("ar", "a", "b")]
    convs = load_prompts(prompt_file(tmp_path))  # 3 conversations, turns 1 + 2 + 1
    report = evaluate(stories, runners, convs, EvalConfig(warmup=False, seed=10), progress=False)
    assert log == [("ar", 10), ("a", 10), ("b", 10),                          # conversation 1
                   ("a", 11), ("a", 12), ("b", 11), ("b", 12), ("ar", 11), ("ar", 12),  # rotated by one
                   ("b", 13), ("ar", 13), ("a", 13)]                          # rotated by two
    assert report["settings"]["timing"] == "interleaved by conversation"
    for d in report["drafters"]:
        assert len(d["speedup_vs_ar_per_conversation"]) == 3
    ratios = {d["name"]: d["speedup_vs_ar_per_conversation"] for d in report["drafters"]}
    assert ratios == {"ar": [1.0] * 3, "a": [2.0] * 3, "b": [0.5] * 3}


class FlipRunner:
    """AR's answer with token `at` replaced: a greedy row that diverges at a known place."""

    name, kind = "flip", "draftsmith"

    def __init__(self, ar, at: int) -> None:
        self.ar, self.at = ar, at

    def run(self, prompt_ids, max_new_tokens, sampling, seed) -> Generation:
        gen = self.ar.run(prompt_ids, max_new_tokens, sampling, seed)
        toks = list(gen.tokens)
        if len(toks) > self.at:
            toks[self.at] = (toks[self.at] + 1) % 512
        return Generation(toks, gen.stats)


def test_divergence_reports_position_and_ar_top2_margin(stories, tmp_path):
    cfg = EvalConfig(max_new_tokens=10, warmup=False)
    ar = make_run("ar", stories, cfg)
    convs = load_prompts(prompt_file(tmp_path))[:2]  # the second has two turns: only its first is examined
    report = evaluate(stories, [("ar", ar), ("flip", FlipRunner(ar, 4))], convs, cfg, progress=False)
    flip = report["drafters"][1]
    assert flip["matches_ar"] is False and "divergences" not in report["drafters"][0]
    div = flip["divergences"]
    assert [(v["conversation"], v["turn"], v["position"]) for v in div] == [("1", 0, 4), ("2", 0, 4)]
    prompt = stories.tokenizer(convs[0].turns[0], return_tensors="pt").input_ids[0]
    ar_tokens = ar.run(prompt, 10, cfg.sampling, cfg.seed).tokens
    top = stories.forward(torch.cat([prompt, torch.tensor(ar_tokens[:4])]), None).logits[-1].topk(2).values
    assert div[0]["ar_token"] == ar_tokens[4]
    assert div[0]["ar_top2_margin"] == pytest.approx(float(top[0] - top[1]))
    assert all(v["ar_top2_margin"] > 0 and v["got_token"] == (v["ar_token"] + 1) % 512 for v in div)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_workers_decode_every_turn_as_one_process_does(stories, tmp_path, temperature):
    """--workers 2 (decode.harness.workers): the same rows, turns in conversation order, the same tokens turn by turn
    (greedy and sampled: each turn keeps its global seed), an auto row drafting with the parent's shape."""
    convs = load_prompts(prompt_file(tmp_path))  # 3 conversations, 4 turns
    cfg = EvalConfig(max_new_tokens=10, sampling=SamplingConfig(temperature), draft_len=3, seed=5)
    specs = ["early-exit:2", "prompt-lookup", "early-exit:2@auto"]
    one = evaluate(stories, prepare(stories, specs, cfg), convs, cfg, progress=False)
    two = evaluate(stories, prepare(stories, specs, cfg), convs, cfg, progress=False, workers=2)
    assert two["settings"]["workers"] == 2 and two["settings"]["torch_threads"] == 1
    assert [d["spec"] for d in two["drafters"]] == [d["spec"] for d in one["drafters"]]
    for a, b in zip(one["drafters"], two["drafters"]):
        assert [(p["id"], p["turn"]) for p in a["prompts"]] == [(p["id"], p["turn"]) for p in b["prompts"]]
        assert len(b["speedup_vs_ar_per_conversation"]) == 3
        if temperature == 0.0:
            assert b["matches_ar"] is True
        if not a["spec"].endswith("@auto"):  # auto may pick another shape from a noisy cost curve
            assert (a["new_tokens"], a["target_forward_passes"]) == (b["new_tokens"], b["target_forward_passes"])
    # the exact tokens, turn by turn (the report keeps counts only), the auto row with a shape fixed in the parent
    from dataclasses import replace

    from decode.harness.evaluate import interleaved

    cold = replace(cfg, warmup=False)
    runs = []
    for workers in (1, 2):
        runners = prepare(stories, specs, cold)
        runners[-1][1].shape = parse_shape("dynamic:topk=2,depth=3,nodes=5", 3)  # as choose_shape would fix it
        runs.append(interleaved(stories, runners, convs, cold, False, workers=workers)[0])
    r1, r2 = runs
    assert [[(t.id, t.turn, t.tokens) for t in run.turns] for run in r1] == \
        [[(t.id, t.turn, t.tokens) for t in run.turns] for run in r2]


def test_auto_calibrates_on_prompts_spread_over_the_list(stories):
    """choose_auto_shapes: 8 first turns evenly spaced over the conversations (one per category of a list that
    runs category by category), not the first few (under --per-category those are all one category)."""
    from decode.harness.evaluate import choose_auto_shapes, encode_prompt, render_turn
    from decode.harness.prompts import Conversation

    convs = [Conversation(str(i), f"cat{i // 3}", [f"Story number {i} begins."]) for i in range(24)]  # 8 x 3
    seen = []
    runner = make_run("early-exit:2@auto", stories, EvalConfig(max_new_tokens=8))
    runner.choose_shape = lambda prompts, curve, run_dir: seen.extend(prompts) or _Described()
    choose_auto_shapes(stories, [("early-exit:2@auto", runner)], convs, None)
    want = [encode_prompt(stories, *render_turn(stories.tokenizer, convs[i].turns, [])) for i in range(0, 24, 3)]
    assert len(seen) == 8 and all(torch.equal(a, b) for a, b in zip(seen, want))


class _Described:
    def describe(self) -> str:
        return "chain k=1"


def test_pool_workers_end_when_their_parent_is_killed(tmp_path):
    """decode.harness.workers' pool initializer: a parent killed by SIGKILL (no cleanup runs) takes its workers with it."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    script = tmp_path / "parent.py"
    script.write_text(
        "import multiprocessing as mp, os, sys, time\n"
        "from concurrent.futures import ProcessPoolExecutor\n"
        "from decode.harness.workers import exit_with_parent\n"
        "if __name__ == '__main__':\n"
        "    with ProcessPoolExecutor(1, mp_context=mp.get_context('spawn'), initializer=exit_with_parent,\n"
        "                             initargs=(os.getpid(), 0.1)) as pool:\n"
        "        print(pool.submit(os.getpid).result(), flush=True)\n"
        "        pool.submit(time.sleep, 120)\n"
        "        time.sleep(120)\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    worker = int(parent.stdout.readline())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(worker, signal.SIGKILL)
    raise AssertionError("the pool's worker outlived its killed parent")
