"""Block drafters (DFlash, DSpark) in the bundled decoder: greedy output equals AR for chains and trees, one
round's sampling distribution equals the target's by exact enumeration, length policies read DSpark's
confidence, and native checkpoints load through the registry (a DSpark one without its heads is refused)."""

from __future__ import annotations

import itertools
import json
import math
from functools import cache

import pytest
import torch
from safetensors.torch import load_file, save_file

from decode.generate import encode_prompt, generate
from decode.policies import make_policy
from decode.protocol import Budget, TargetStep
from decode.sampling import SamplingConfig, probs_from_logits
from decode.target import Target
from decode.tree import DraftTree, Shape, path_to
from decode.verify import verify_sampling
from drafters.registry import make_drafter
from drafters.serving.checkpoint import save_drafter
from drafters.sources.ar import ARDrafter
from tests.conftest import tiny_model, tiny_target
from tests.decode.test_sampling_exact import enumerate_outcomes
from tests.drafters.batches import record_rounds
from tests.drafters.trainable.test_block import KINDS, build

SHAPES = {
    "chain": Shape("chain", k=4),
    "long-chain": Shape("chain", k=8),  # capped at the block's K - 1 = 3
    "static": Shape("static", choices=((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0))),
    "dynamic": Shape("dynamic", topk=3, depth=4, nodes=10),
}
PROMPT = torch.tensor([1, 5, 9, 33, 17, 4, 60])


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equals_ar_tiny(tiny, kind):
    ref = generate(tiny, ARDrafter(), PROMPT, 20).tokens
    for mask_token in (-1, 7):
        m = build(kind, tiny, mask_token_id=mask_token)
        for name, shape in SHAPES.items():
            d = m.drafter()
            rounds = record_rounds(d)
            gen = generate(tiny, d, PROMPT, 20, shape=shape)
            assert gen.tokens == ref, (kind, mask_token, name)
            assert d.forward_passes == sum(1 for t in rounds if t.size)  # one pass a drafting round, any shape
            assert max(t.depth() for t in rounds) == 3


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equals_ar_bundled(stories, kind):
    ids = encode_prompt(stories, "One day, a boy named Tim went to the park with his mom.")
    ref = generate(stories, ARDrafter(), ids, 48).tokens
    m = build(kind, stories, num_layers=2)
    for shape in (Shape("chain", k=7), SHAPES["dynamic"]):
        assert generate(stories, m.drafter(), ids, 48, shape=shape).tokens == ref


@pytest.mark.parametrize("kind", KINDS)
def test_sampling_chains_carry_q_and_trees_are_top_k(kind):
    t = tiny_target("qwen3")
    m = build(kind, t)
    trees = []
    for shape in (SHAPES["chain"], SHAPES["dynamic"]):
        d = m.drafter()
        rounds = record_rounds(d)
        assert (
            len(generate(t, d, PROMPT, 12, sampling=SamplingConfig(temperature=0.8), shape=shape, seed=3).tokens) == 12
        )
        trees.append(rounds)
    chains, branched = trees
    assert all(c.q is not None and torch.allclose(c.q.sum(-1), torch.ones(c.size, dtype=c.q.dtype)) for c in chains)
    assert all(c.conf is not None and c.conf.shape == (c.size,) for c in chains)
    assert all(b.q is None for b in branched)


# --- exact enumeration of one sampling round -------------------------------------------------------------

V = 5


class Round:
    """One round on a tiny float64 target over 5 tokens: a drafter's draft (its draws scripted), verified
    against the target's own distributions (computed by full forwards, memoised), the emitted tokens returned."""

    def __init__(self, kind: str, cfg: SamplingConfig, shape: Shape, draft_vocab: int = 0) -> None:
        self.target = Target(tiny_model("qwen3", vocab=V, seed=4).double())
        with torch.no_grad():
            self.target.lm_head.weight.mul_(4.0)  # peaked distributions: drafts get accepted and rejected
        self.module = build(kind, self.target, draft_vocab_size=draft_vocab).double().eval()
        self.cfg, self.shape = cfg, shape
        self.prompt, self.first = torch.tensor([1, 3, 4, 0]), 3
        with torch.no_grad():
            out = self.target.model(input_ids=self.prompt[None], output_hidden_states=True)
        self.hidden = {i: out.hidden_states[i][0] for i in self.module.decode_hidden_ids}
        self.p = cache(self._p)

    def _p(self, ctx: tuple[int, ...]) -> torch.Tensor:
        """The target's (filtered) next-token distribution after prompt + first + ctx. [V] float64"""
        ids = torch.tensor([*self.prompt.tolist(), self.first, *ctx])[None]
        with torch.no_grad():
            return probs_from_logits(self.target.model(input_ids=ids).logits[0, -1], self.cfg)

    def __call__(self, rng) -> tuple[int, ...]:
        d = self.module.drafter()
        tokens = torch.tensor([*self.prompt[1:].tolist(), self.first])
        d.begin(self.prompt, TargetStep(tokens, self.hidden, [], self.prompt.numel()))
        tree: DraftTree = d.propose(Budget(self.shape, self.cfg, rng))
        rows = [()] + [tuple(tree.tokens[path_to(tree.parents, n)].tolist()) for n in range(tree.size)]
        v = verify_sampling(tree, torch.stack([self.p(r) for r in rows]), rng)
        return tuple(tree.tokens[v.path].tolist()) + (v.bonus,)

    def ar(self, seq: tuple[int, ...]) -> float:
        return math.prod(float(self.p(seq[:i])[t]) for i, t in enumerate(seq))


@pytest.mark.parametrize(
    "kind,shape,draft_vocab",
    [
        ("dflash", Shape("chain", k=2), 0),
        ("dspark", Shape("chain", k=2), 0),
        ("dspark", Shape("static", choices=((0,), (1,), (0, 0))), 0),
        ("dspark", Shape("chain", k=2), 3),  # a draft vocabulary of tokens 0..2: q is zero on 3 and 4
        ("dflash", Shape("static", choices=((0,), (1,), (0, 0))), 3),
    ],
    ids=["dflash-chain", "dspark-chain", "dspark-tree", "dspark-chain-vocab3", "dflash-tree-vocab3"],
)
@pytest.mark.parametrize("cfg", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=3)])
def test_one_sampling_round_has_exactly_the_targets_distribution(kind, shape, draft_vocab, cfg):
    run = Round(kind, cfg, shape, draft_vocab)
    outcomes = enumerate_outcomes(run)
    assert abs(sum(outcomes.values()) - 1.0) < 1e-9
    assert max(len(s) for s in outcomes) > 1  # drafts do get accepted
    for j in (1, 2, 3):
        got: dict[tuple[int, ...], float] = {}
        for seq, w in outcomes.items():
            if len(seq) >= j:
                got[seq[:j]] = got.get(seq[:j], 0.0) + w
            else:  # complete the emitted prefix with the target's AR distribution
                for tail in itertools.product(range(V), repeat=j - len(seq)):
                    got[seq + tail] = got.get(seq + tail, 0.0) + w * run.ar(seq + tail) / run.ar(seq)
        for seq in itertools.product(range(V), repeat=j):
            assert abs(got.get(seq, 0.0) - run.ar(seq)) < 1e-9, (j, seq)


# --- length policies, checkpoints --------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["threshold:p=0.5", "stopping"])
def test_length_policies_read_the_confidence_head(policy):
    t = tiny_target("qwen3")
    m = build("dspark", t, block_size=6)
    with torch.no_grad():
        m.conf_head.bias.fill_(-1.0)  # P(accepted) ~ 0.27 at every position: the threshold stops at once
        m.conf_head.weight.zero_()
    d = m.drafter()
    rounds = record_rounds(d)
    gen = generate(t, d, PROMPT, 16, shape=Shape("chain", k=5), policy=make_policy(policy, pass_cost=lambda n: 1.0))
    assert gen.tokens == generate(t, ARDrafter(), PROMPT, 16).tokens
    p = float(torch.sigmoid(torch.tensor(-1.0)))
    assert all(torch.allclose(r.conf, torch.full((r.size,), p)) for r in rounds if r.size)
    if policy.startswith("threshold"):
        assert {r.size for r in rounds} - {0} == {1}


@pytest.mark.parametrize("kind", KINDS)
def test_native_checkpoint_round_trip_through_the_registry(tmp_path, kind):
    target = tiny_target("qwen3", seed=3)
    m = build(kind, target, mask_token_id=9 if kind == "dflash" else -1)
    out = save_drafter(m, tmp_path / "export", target_id="tiny")
    meta = json.loads((out / "config.json").read_text())
    assert meta["draftsmith_drafter"] == kind and meta["capture_ids"] == list(m.config.capture_ids)
    assert not any(k.startswith(("lm_head", "embed")) for k in load_file(str(out / "model.safetensors")))
    ref = generate(target, ARDrafter(), PROMPT, 12).tokens
    for dtype in (torch.float32, torch.bfloat16):  # a bf16 target drafts in bf16, still lossless
        fresh = Target(tiny_model("qwen3", seed=3).to(dtype))
        loaded = make_drafter(str(out), fresh)
        assert {p.dtype for p in loaded.m.parameters()} == {dtype}
        for shape in (Shape("chain", k=3), SHAPES["dynamic"]):
            own, theirs = m.drafter(), make_drafter(str(out), fresh)
            a, b = record_rounds(own), record_rounds(theirs)
            assert generate(fresh, theirs, PROMPT, 12, shape=shape).tokens == ref
            if dtype == torch.float32:  # the same target weights: the same drafts
                assert generate(target, own, PROMPT, 12, shape=shape).tokens == ref
                assert [r.tokens.tolist() for r in a] == [r.tokens.tolist() for r in b]


def test_a_dspark_checkpoint_without_its_heads_is_refused(tmp_path):
    target = tiny_target("qwen3")
    out = save_drafter(build("dspark", target), tmp_path / "dspark")
    state = load_file(str(out / "model.safetensors"))
    save_file(
        {k: v for k, v in state.items() if not k.startswith(("markov.", "conf_head."))}, str(out / "model.safetensors")
    )
    with pytest.raises(
        ValueError, match=r"missing \['conf_head.bias', 'conf_head.weight', 'markov.embed.weight'.*DSpark"
    ):
        make_drafter(str(out), target)
    flash = save_drafter(build("dflash", target), tmp_path / "dflash")
    meta = json.loads((flash / "config.json").read_text())
    meta["draftsmith_drafter"] = "dspark"
    (flash / "config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"Markov and confidence heads"):
        make_drafter(str(flash), target)
    meta["draftsmith_drafter"], meta["config"]["mask_token_id"] = "dflash", 500
    (flash / "config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"config.json: mask_token_id 500 is outside the target's vocabulary"):
        make_drafter(str(flash), target)
