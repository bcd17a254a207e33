"""The decoding-faithful simulated τ (train/simeval.py): it equals decode.harness.evaluate's τ on the same prompts,
and its eval set (prompts + the target's greedy continuations) is deterministic and cached."""

from __future__ import annotations

import json

import pytest
import torch

from tests.drafters.batches import fit, make_batch
from train.loop import TrainConfig
from train.simeval import held_out_prompts, load_or_build, prefix_prompt, prompt_set, sim_eval

PROMPTS = [
    "Once upon a time, there was a little girl named Lily.",
    "The dog ran to the park.",
    "Tom had a big red ball.",
]


def test_prefix_prompt_rules():
    ids = torch.arange(10, 30)
    story = torch.tensor([False] + [True] * 19)  # only the start token is untrained: a fixed-length prefix
    chat = torch.tensor([False] * 7 + [True] * 13)  # a prompt of 7 tokens, then the trained response
    assert prefix_prompt(ids, story, 5) == list(range(10, 15))
    assert prefix_prompt(ids, chat, 5) == list(range(10, 17))
    assert prefix_prompt(ids[:5], story[:5], 5) is None  # nothing left to continue
    items = [
        {"input_ids": ids, "loss_mask": story},
        {
            "input_ids": torch.cat([ids, ids]),
            "loss_mask": torch.cat([chat, story]),
            "segments": torch.tensor([1] * 20 + [2] * 20),
        },
    ]
    assert held_out_prompts(items, 5, 5, room=100) == [list(range(10, 15)), list(range(10, 17))]
    assert held_out_prompts(items, 5, 5, room=6) == [list(range(10, 15))]  # too long for the positions


@pytest.mark.parametrize("kind", ["eagle3", "medusa", "layerskip"])
def test_simulated_tau_equals_decoded_tau(tmp_path, stories, kind):
    """Same prompts, same drafter: the training eval's τ is decode.harness.evaluate's τ, exactly, chain and tree."""
    from decode.harness.evaluate import evaluate, prepare
    from decode.harness.prompts import load_prompts
    from decode.harness.runs import EvalConfig
    from drafters.serving.checkpoint import new_drafter, save_drafter

    (tmp_path / "p.txt").write_text("\n".join(PROMPTS) + "\n")
    cfg = TrainConfig(
        sim_prompts=str(tmp_path / "p.txt"),
        sim_eval_prompts=3,
        sim_max_new_tokens=40,
        sim_chain=5,
        sim_tree="dynamic:topk=4,depth=4,nodes=12",
    )
    items = load_or_build(tmp_path / "sim.json", stories, prompt_set(cfg, stories, []), 40)
    # a drafter that accepts something: fitted to these very continuations (a few steps memorise them)
    seqs = [it["prompt"] + it["greedy"] for it in items]
    n = min(len(s) for s in seqs)
    torch.manual_seed(0)
    cfgs = {"eagle3": {"draft_vocab_size": 256}, "medusa": {"num_heads": 3}, "layerskip": {"draft_exit": 2}}
    counts = {"token_counts": torch.bincount(torch.tensor(sum(seqs, [])), minlength=stories.vocab_size)}
    module = new_drafter(kind, stories, cfgs[kind], **(counts if kind == "eagle3" else {}))
    module.train()
    fit(
        module,
        make_batch(stories, torch.tensor([s[:n] for s in seqs]), module.feature_ids(stories.num_layers)),
        steps=40,
        lr=3e-3,
    )
    sim = sim_eval(module, stories, items, cfg)
    assert module.training  # the eval leaves the module as it found it
    save_drafter(module, tmp_path / "export")
    ecfg = EvalConfig(max_new_tokens=40, draft_len=5, warmup=False)
    specs = [str(tmp_path / "export"), f"{tmp_path / 'export'}@{cfg.sim_tree}"]
    report = evaluate(stories, prepare(stories, specs, ecfg), load_prompts(tmp_path / "p.txt"), ecfg, progress=False)
    ar, chain, tree = report["drafters"]
    assert chain["matches_ar"] and tree["matches_ar"] and sim["eval/sim_matches_ar"] == 1.0
    assert sim["eval/sim_tau_chain"] == chain["mean_accepted_tokens"]
    assert sim["eval/sim_tau_tree"] == tree["mean_accepted_tokens"]
    assert sim["eval/sim_tau_chain"] > 1.0 and sim["eval/sim_tau_tree"] > 1.0  # some drafts were accepted
    # the cached greedy continuations are decode.harness.evaluate's AR outputs
    ar_report = json.loads((tmp_path / "sim.json").read_text())
    assert [it["prompt"] for it in ar_report["items"]] == [it["prompt"] for it in items]
    assert ar["new_tokens"] == sum(len(it["greedy"]) for it in items)


def test_eval_set_is_deterministic_and_cached(tmp_path, stories, monkeypatch):
    from train import simeval

    items = [
        {"input_ids": torch.tensor([1] + list(range(40, 70))), "loss_mask": torch.tensor([False] + [True] * 30)},
        {"input_ids": torch.tensor([1] + list(range(90, 110))), "loss_mask": torch.tensor([False] + [True] * 20)},
    ]
    cfg = TrainConfig(sim_eval_prompts=2, sim_prompt_len=6, sim_max_new_tokens=24)
    prompts = prompt_set(cfg, stories, items)
    assert prompts == prompt_set(cfg, stories, items) == [[1, 40, 41, 42, 43, 44], [1, 90, 91, 92, 93, 94]]
    a = load_or_build(tmp_path / "a.json", stories, prompts, 24)
    b = load_or_build(tmp_path / "b.json", stories, prompts, 24)
    assert a == b and all(len(it["greedy"]) == 24 or it["greedy"][-1] in stories.eos_ids for it in a)
    # cached: a second build with the same key never runs the target
    monkeypatch.setattr(simeval, "greedy_continuations", lambda *a: pytest.fail("rebuilt a cached eval set"))
    assert load_or_build(tmp_path / "a.json", stories, prompts, 24) == a
    # a different key (length, prompts) rebuilds
    monkeypatch.undo()
    assert load_or_build(tmp_path / "a.json", stories, prompts, 12)[0]["greedy"] == a[0]["greedy"][:12]
    assert load_or_build(tmp_path / "a.json", stories, prompts[:1], 12) == [
        {"prompt": prompts[0], "greedy": a[0]["greedy"][:12]}
    ]
