"""How `python -m decode.evaluate` runs its turns: a conversation's later turns carry the run's own answers,
timing interleaved by conversation with one seed per turn, divergences from AR located, --workers decoding
what one process decodes, @auto calibrating on prompts spread over the list, and pool workers that end with
their parent. Stand-in runners (echo, seed-recording, token-flipping) make each of these visible."""

from __future__ import annotations

import pytest
import torch

from decode.generate import Generation
from decode.harness.evaluate import evaluate, make_run, prepare
from decode.harness.prompts import load_prompts
from decode.harness.runs import EvalConfig, run_spec
from decode.metrics import GenStats
from decode.sampling import SamplingConfig
from decode.tree import parse_shape
from tests.decode.harness.eval_prompts import prompt_file


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
    assert log == [
        ("ar", 10),
        ("a", 10),
        ("b", 10),  # conversation 1
        ("a", 11),
        ("a", 12),
        ("b", 11),
        ("b", 12),
        ("ar", 11),
        ("ar", 12),  # rotated by one
        ("b", 13),
        ("ar", 13),
        ("a", 13),
    ]  # rotated by two
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
    with torch.inference_mode():  # the decoder's own runtime (a pass with autograd runs HF's modules)
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
    assert [[(t.id, t.turn, t.tokens) for t in run.turns] for run in r1] == [
        [(t.id, t.turn, t.tokens) for t in run.turns] for run in r2
    ]


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
        "        time.sleep(120)\n"
    )
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
