"""Draft-length policies: the rules by hand, that they never change the output, and their errors."""

from __future__ import annotations

import pytest
import torch

from decode.generate import encode_prompt, generate, policy_for
from decode.policies import (
    Costs,
    LearningPolicy,
    Round,
    StoppingPolicy,
    best_length,
    constant_cost,
    expected_tokens,
    make_policy,
    stop_rule,
)
from decode.tree import Shape, grow_chain
from drafters.registry import make_drafter
from drafters.sources.ar import ARDrafter
from tests.conftest import DEV_PROMPTS, STORIES

POLICY_SPECS = ["fixed", "learning", "threshold", "threshold:p=0.9", "stopping"]


def scripted_step(confs: list[float], calls: list[int]):
    """A drafter step whose i-th call puts probability confs[i] on token i + 3 (vocab 16)."""

    def step(ids, tokens, parents):
        i = len(calls)
        calls.append(i)
        p = torch.full((16,), (1 - confs[i]) / 15)
        p[i + 3] = confs[i]
        return p.log().view(1, -1)

    return step


def greedy(lp):
    return int(lp.argmax()), None


def test_chain_stops_after_the_first_unconfident_token_and_skips_later_steps():
    calls: list[int] = []
    tree = grow_chain(scripted_step([0.9, 0.8, 0.3, 0.9, 0.9], calls), 0, 5, greedy, stop=lambda c: c[-1] < 0.4)
    assert tree.tokens.tolist() == [3, 4, 5]  # the token below the threshold stays (already paid for)
    assert len(calls) == 3  # no drafter step after the stop
    torch.testing.assert_close(tree.conf, torch.tensor([0.9, 0.8, 0.3]))
    assert grow_chain(scripted_step([0.9] * 5, []), 0, 5, greedy, stop=lambda c: c[-1] < 0.4).size == 5


def test_stopping_rule_by_hand():
    # target pass 1 s, drafter step 0.1 s. After 1 token with p = 0.5: P1 = 0.5, E = 1.5, T = 1.1;
    # one more token adds 0.1 s: rate of the gain 0.5 / 0.1 = 5 > 1.5 / 1.1 -> go on.
    rule = stop_rule(0.1, constant_cost(1.0), calib=1.0)
    assert not rule([0.5])
    # P3 = 0.5^3 = 0.125, E = 1 + 0.5 + 0.25 + 0.125 = 1.875, T = 1.3: 0.125 / 0.1 = 1.25 < 1.44 -> stop
    assert rule([0.5, 0.5, 0.5])
    assert not rule([0.5, 0.5])  # 0.25 / 0.1 = 2.5 > 1.75 / 1.2
    # a streamed target (20 s a pass) makes drafting nearly free: keep going far down the chain
    assert not stop_rule(0.1, constant_cost(20.0), 1.0)([0.5] * 6)
    # a drafter known to be confidently wrong (calibration 0.05) stops at once
    assert stop_rule(0.1, constant_cost(1.0), 0.05)([0.9])


def test_learning_length_by_hand():
    costs = Costs(constant_cost(1.0))
    costs.observe(Round(4, 0, draft_s=0.4, verify_s=1.0, rows=5))  # 0.1 s per drafted token
    assert expected_tokens(0.5, 2) == pytest.approx(1.75) and expected_tokens(1.0, 3) == 4
    assert best_length(0.0, costs, 16) == 1  # nothing is ever accepted: shortest draft
    assert best_length(1.0, costs, 16) == 16  # everything is accepted: longest draft
    # alpha 0.5: rates E(k) / (1 + 0.1 k) are 1.36, 1.46, 1.44 -> k = 2
    assert best_length(0.5, costs, 16) == 2
    policy = LearningPolicy(Costs(constant_cost(20.0)), max_len=12)
    assert policy.shape(Shape("chain", k=8)).k == 8  # before any round: the base length
    for _ in range(5):
        policy.observe(Round(8, 8, draft_s=0.08, verify_s=0.01, rows=9, conf=None))
    assert policy.shape(Shape("chain", k=8)).k == 12  # all accepted, cheap drafts: grows to its max
    for _ in range(60):
        policy.observe(Round(8, 0, draft_s=0.08, verify_s=0.01, rows=9, conf=None))
    assert policy.shape(Shape("chain", k=8)).k <= 2  # then nothing accepted: shrinks


def test_stopping_policy_calibrates_on_a_confidently_wrong_drafter():
    policy = StoppingPolicy(Costs(constant_cost(1.0)))
    assert policy.shape(Shape("chain", k=8)).stop is None  # nothing measured yet: full chain
    for _ in range(20):
        policy.observe(Round(8, 0, draft_s=0.8, verify_s=1.0, rows=9, conf=[0.95] * 8))
    shape = policy.shape(Shape("chain", k=8))
    assert shape.k == 8 and shape.stop([0.95])  # calibrated down: one token is enough


@pytest.mark.parametrize("spec", POLICY_SPECS)
@pytest.mark.parametrize("pass_s", [None, 20.0])
def test_policies_never_change_the_output_bundled(stories, spec, pass_s):
    ids = encode_prompt(stories, DEV_PROMPTS.read_text().splitlines()[1])
    ref = generate(stories, ARDrafter(), ids, 48)
    cost = constant_cost(pass_s) if pass_s else None
    gen = generate(stories, make_drafter("early-exit:3", stories), ids, 48, policy=make_policy(spec, cost))
    assert gen.tokens == ref.tokens
    assert gen.stats.draft_nodes > 0


@pytest.mark.parametrize("spec", ["learning", "threshold:p=0.5", "stopping"])
def test_policies_never_change_the_output_tiny(tiny, spec):
    torch.manual_seed(3)
    prompt = torch.randint(3, 128, (6,))
    ref = generate(tiny, ARDrafter(), prompt, 40)
    for drafter in ["early-exit:2", "skip:1"]:
        gen = generate(tiny, make_drafter(drafter, tiny), prompt, 40, policy=make_policy(spec))
        assert gen.tokens == ref.tokens, drafter


def test_policies_change_the_draft_length(stories):
    ids = encode_prompt(stories, DEV_PROMPTS.read_text().splitlines()[2])
    nodes, depth = {}, {}
    for spec in ["fixed", "threshold:p=1.0", "stopping"]:
        g = generate(stories, make_drafter("early-exit:2", stories), ids, 40, policy=make_policy(spec))
        nodes[spec], depth[spec] = g.stats.draft_nodes / g.stats.rounds, len(g.stats.proposed_by_depth)
    assert depth["threshold:p=1.0"] == 1 and depth["fixed"] == 8  # every token is below p = 1: one-token drafts
    assert nodes["stopping"] < nodes["fixed"]  # early-exit:2 is rarely right: stopping drafts less


def test_learning_works_with_prompt_lookup(stories):
    ids = encode_prompt(stories, DEV_PROMPTS.read_text().splitlines()[3])
    ref = generate(stories, ARDrafter(), ids, 48)
    gen = generate(stories, make_drafter("prompt-lookup", stories), ids, 48, policy=make_policy("learning"))
    assert gen.tokens == ref.tokens


@pytest.mark.parametrize("drafter", ["prompt-lookup", "lookahead"])
@pytest.mark.parametrize("spec", ["threshold", "stopping"])
def test_confidence_policies_refuse_drafters_without_probabilities(tiny, drafter, spec):
    with pytest.raises(ValueError, match="per-token probabilities"):
        generate(tiny, make_drafter(drafter, tiny), torch.tensor([3, 4, 5]), 8, policy=make_policy(spec))


def test_undeclared_drafter_without_probabilities_is_caught_at_its_first_draft(tiny):
    class Bare:  # proposes chains but neither sets conf nor declares token_probs
        name, hidden_ids, forward_passes = "bare", (), 0

        def begin(self, prompt_ids, step): ...

        def propose(self, budget):
            from decode.tree import DraftTree

            return DraftTree.chain([5, 6])

        def accept(self, step): ...

    with pytest.raises(ValueError, match="bare proposes without them"):
        generate(tiny, Bare(), torch.tensor([3, 4, 5]), 8, policy=make_policy("threshold"))


@pytest.mark.parametrize(
    "spec,match",
    [
        ("greedy", "available policies"),
        ("threshold:q=1", "not one of"),
        ("threshold:p=2", r"\[0, 1\]"),
        ("learning:max=x", "needs an integer"),
        ("stopping:decay=3", "decay"),
    ],
)
def test_bad_policy_specs(spec, match):
    with pytest.raises(ValueError, match=match):
        make_policy(spec)


def test_stop_rules_need_a_chain(stories):
    ids = encode_prompt(stories, "Once upon a time")
    with pytest.raises(ValueError, match="--tree chain"):
        generate(
            stories,
            make_drafter("early-exit:2", stories),
            ids,
            8,
            shape=Shape("dynamic", topk=2, depth=3, nodes=6),
            policy=make_policy("stopping"),
        )


def test_target_pass_s_flag(capsys):
    from decode.generate import main

    args = [
        "--target",
        str(STORIES),
        "--prompt",
        "Once upon a time",
        "--max-new-tokens",
        "6",
        "--drafter",
        "early-exit:3",
        "--policy",
        "stopping",
        "--target-pass-s",
        "20",
    ]
    assert main(args) == 0
    assert "6 tokens" in capsys.readouterr().err
    policy = policy_for("stopping", 20.0)
    assert policy.name == "stopping" and policy.costs.target_s(9) == 20.0
    with pytest.raises(ValueError, match="> 0"):
        policy_for("stopping", 0.0)
