"""The small-budget levers (issue 19), each a recipe option doing what it says: TTT steps and step weights,
hidden-state noise, a frozen EAGLE-3 head, the full draft vocabulary, Muon, the lr schedules, Medusa's
identity init and copied heads, LayerSkip's LoRA rank and layers; and one tiny EAGLE-3 recipe with them
all on, resumed exactly."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from decode.generate import generate
from decode.target import Target
from decode.tree import Shape
from drafters.serving.checkpoint import new_drafter
from drafters.trainable.eagle import Eagle1, Eagle1Config
from drafters.trainable.eagle3 import Eagle3, Eagle3Config
from drafters.trainable.layerskip import LayerSkip, LayerSkipConfig
from drafters.trainable.layerskip.lora import ADAPTER
from drafters.trainable.medusa import Medusa, MedusaConfig
from drafters.trainable.noise import add_noise
from tests.conftest import REPO, tiny_target
from tests.drafters.batches import make_batch, random_sequences, record_rounds
from tests.train.loop_runs import crash_at, recipe_overrides, regen, run, write_recipe  # noqa: F401 (regen: a fixture)
from train.checkpoints import checkpoints
from train.config import ConfigError, TrainConfig, load_recipe
from train.loop import lr_factor
from train.optim import make_optimizers, muon_split

PROMPT = torch.tensor([1, 5, 9, 33, 17, 4])


def eagle(kind: str, target: Target, seed: int = 0, **cfg):
    """An EAGLE-1/3 module with fixed initial weights (torch seed 0) whatever `cfg` says."""
    torch.manual_seed(0)
    if kind == "eagle3":
        return Eagle3(target, Eagle3Config(draft_vocab_size=64, ttt_steps=3, **cfg), seed=seed)
    return Eagle1(target, Eagle1Config(**cfg), seed=seed)


# --- 1. training-time test: steps and step weights -------------------------------------------------------


@pytest.mark.parametrize("decay", [1.0, 0.8])
def test_ttt_steps_and_step_weights(decay):
    t = tiny_target()
    m = eagle("eagle3", t, step_decay=decay)
    _, metrics = m(make_batch(t, random_sequences(t, 2, 12), m.feature_ids()))
    ce = [metrics[f"ce_{k}"] for k in (1, 2, 3)]
    assert "ce_4" not in metrics
    assert metrics["loss"] == pytest.approx(sum(decay**k * c for k, c in enumerate(ce)), rel=1e-5)


# --- 2. hidden-state noise ---------------------------------------------------------------------------------


def test_noise_draws():
    u = add_noise(torch.zeros(20000), "uniform", 0.1, torch.Generator().manual_seed(0))
    assert 0.099 < float(u.abs().max()) <= 0.1 and abs(float(u.mean())) < 0.005  # U(-0.1, 0.1)
    n = add_noise(torch.zeros(20000), "gaussian", 0.05, torch.Generator().manual_seed(0))
    assert float(n.std()) == pytest.approx(0.05, rel=0.05)
    # the draws do not depend on the features' dtype (bf16 caches draw what fp32 ones do)
    b = add_noise(torch.zeros(20000, dtype=torch.bfloat16), "gaussian", 0.05, torch.Generator().manual_seed(0))
    assert b.dtype == torch.bfloat16 and torch.equal(b, n.to(torch.bfloat16))
    # relative: each element moved by std of its own size; zeros stay zeros, the same draws as gaussian
    x = torch.cat([torch.zeros(10000), torch.full((10000,), 2.0), torch.full((10000,), -60.0)])
    r = add_noise(x, "relative", 0.05, torch.Generator().manual_seed(0))
    assert torch.equal(r[:10000], x[:10000])
    assert float((r[10000:20000] / 2 - 1).std()) == pytest.approx(0.05, rel=0.05)
    assert float((r[20000:] / -60 - 1).std()) == pytest.approx(0.05, rel=0.05)
    g = add_noise(torch.zeros(30000), "gaussian", 0.05, torch.Generator().manual_seed(0))
    torch.testing.assert_close(r, x * (1 + g))


@pytest.mark.parametrize("kind,noise", [("eagle3", "gaussian"), ("eagle1", "gaussian"), ("eagle3", "relative")])
def test_noise_changes_training_only_and_is_seeded(kind, noise):
    t = tiny_target()
    noisy, plain = eagle(kind, t, noise=noise, noise_std=0.5), eagle(kind, t)
    batch = make_batch(t, random_sequences(t, 2, 12), noisy.feature_ids())
    rng = torch.get_rng_state()
    loss = [float(noisy(batch, 3)[0]) for _ in range(2)]  # two micro-batches of step 3
    assert torch.equal(rng, torch.get_rng_state())  # drawn from the drafter's own generator only
    clean = float(plain(batch, 3)[0])
    assert loss[0] != clean and loss[1] != loss[0]
    # the same seed draws the same noise (step 3, first then second call); another seed does not
    again = eagle(kind, t, noise=noise, noise_std=0.5)
    assert [float(again(batch, 3)[0]) for _ in range(2)] == loss
    assert float(eagle(kind, t, seed=1, noise=noise, noise_std=0.5)(batch, 3)[0]) != loss[0]
    # eval and decoding never see it
    noisy.eval(), plain.eval()
    assert float(noisy(batch, 3)[0]) == clean
    assert noisy.position_accuracy(batch) == plain.position_accuracy(batch)
    trees = []
    for m in (noisy, plain):
        d = m.drafter()
        rounds = record_rounds(d)
        generate(t, d, PROMPT, 12, shape=Shape("chain", k=3))
        trees.append([r.tokens.tolist() for r in rounds])
    assert trees[0] == trees[1]


def test_feature_noise_is_the_old_spelling_of_uniform_noise(tmp_path):
    t = tiny_target()
    old = new_drafter("eagle1", t, {"ce_weight": 0.1, "feature_noise": 0.2, "eval_depth": 7})  # an old config.json
    assert (old.config.noise, old.config.noise_std, old.config.feature_noise) == ("uniform", 0.1, 0.0)
    with pytest.raises(ValueError, match="feature_noise 0.2 and noise 'gaussian' both set"):
        Eagle1Config(feature_noise=0.2, noise="gaussian")
    recipe = write_recipe(tmp_path)
    with pytest.raises(ConfigError, match="drafter.eagle3.noise"):
        load_recipe(recipe, ["drafter.eagle3.noise=loud"])
    with pytest.raises(ConfigError, match=r"drafter.eagle1.noise_std=-1.0: must be a number >= 0"):
        load_recipe(recipe, ["drafter.eagle1.noise_std=-1"])
    r = load_recipe(recipe, ["drafter.eagle3.noise=none", "drafter.eagle3.freeze_head=true"])
    assert r.drafter.eagle3.noise == "none" and r.drafter.eagle3.freeze_head is True


# --- 3. the EAGLE-3 head: frozen copy, and Muon/AdamW groups ------------------------------------------------


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_frozen_head_stays_the_targets_copy(optimizer):
    t = tiny_target()
    m = eagle("eagle3", t, freeze_head=True)
    rows = t.lm_head.weight[m.draft_ids]
    opts = make_optimizers(m, TrainConfig(optimizer=optimizer, lr=1e-2))
    in_opt = {id(p) for o in opts for g in o.param_groups for p in g["params"]}
    assert id(m.lm_head.weight) not in in_opt and id(m.norm.weight) not in in_opt
    assert in_opt == {id(p) for n, p in m.named_parameters() if n not in ("lm_head.weight", "norm.weight")}
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    batch = make_batch(t, random_sequences(t, 2, 12), m.feature_ids())
    for step in range(3):
        loss, _ = m(batch, step)
        loss.backward()
        for o in opts:
            o.step()
            o.zero_grad()
    assert torch.equal(m.lm_head.weight, rows) and torch.equal(m.norm.weight, t.norm.weight)
    assert not torch.equal(m.fc.weight, before["fc.weight"])
    assert not torch.equal(m.midlayer.mlp.down_proj.weight, before["midlayer.mlp.down_proj.weight"])


def test_muon_takes_matrices_and_adamw_the_rest(tmp_path):
    t = tiny_target()
    m = eagle("eagle3", t)
    muon, adamw = muon_split(m.named_parameters())
    names = {id(p): n for n, p in m.named_parameters()}
    assert sorted(names[id(p)] for p in muon) == sorted(
        ["fc.weight"]
        + [
            f"midlayer.{k}.weight"
            for k in (
                "self_attn.q_proj",
                "self_attn.k_proj",
                "self_attn.v_proj",
                "self_attn.o_proj",
                "mlp.gate_proj",
                "mlp.up_proj",
                "mlp.down_proj",
            )
        ]
    )
    assert "lm_head.weight" in {names[id(p)] for p in adamw}  # vocabulary rows: never Muon
    opts = make_optimizers(m, TrainConfig(optimizer="muon"))
    assert [type(o).__name__ for o in opts] == ["Muon", "AdamW"]
    med = Medusa(t, MedusaConfig(num_heads=2, head="copied"))
    muon, adamw = muon_split(med.named_parameters())
    assert len(muon) == 2 and len(adamw) == 4  # block weights | block biases + the two copied heads
    with pytest.raises(ConfigError, match="train.optimizer"):
        load_recipe(write_recipe(tmp_path), ["train.optimizer=sgd"])
    with pytest.raises(ValueError, match="train.optimizer=muon is supported on one process and DDP, not DEEPSPEED"):
        make_optimizers(m, TrainConfig(optimizer="muon"), "DEEPSPEED")


def test_our_muon_is_torchs_with_the_newton_schulz_dtype_chosen():
    """With ns_dtype=bf16 our Muon's step is torch.optim.Muon's bit for bit (its loop, nesterov and lr adjustment
    replicated); with fp32 (devices without bf16 arithmetic) the update differs only by bf16's rounding; tall
    and wide matrices both; the state is torch's (momentum_buffer), so checkpoints carry over."""
    from train.optim import Muon

    g = torch.Generator().manual_seed(0)
    shapes = [(6, 10), (12, 5)]
    start = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(3)]

    def run(make) -> list[torch.Tensor]:
        ps = [torch.nn.Parameter(x.clone()) for x in start]
        opt = make(ps)
        for gs in grads:
            for p, gr in zip(ps, gs):
                p.grad = gr.clone()
            opt.step()
        assert sorted(opt.state[ps[0]]) == ["momentum_buffer"]
        return [p.detach() for p in ps]

    kw = dict(lr=1e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    ref = run(lambda ps: torch.optim.Muon(ps, **kw))
    bf16 = run(lambda ps: Muon(ps, ns_dtype=torch.bfloat16, **kw))
    fp32 = run(lambda ps: Muon(ps, ns_dtype=torch.float32, **kw))
    for r, b, f, x in zip(ref, bf16, fp32, start):
        assert torch.equal(r, b)
        moved = (r - x).abs().max()
        assert 0 < (f - r).abs().max() < 0.05 * moved  # the same update up to bf16 rounding in the iteration


@pytest.mark.parametrize("native", [True, False])
def test_muon_iterates_in_fp32_where_the_device_has_no_bf16(native, monkeypatch):
    import train.optim

    monkeypatch.setattr(train.optim, "has_bf16", lambda device: native)
    t = tiny_target()
    opts = make_optimizers(Eagle3(t, Eagle3Config(draft_vocab_size=64)), TrainConfig(optimizer="muon"))
    assert opts[0].ns_dtype == (torch.bfloat16 if native else torch.float32)


# --- 5. lr schedules -----------------------------------------------------------------------------------------


def test_linear_and_constant_schedules():
    lin = TrainConfig(steps=110, warmup_steps=10, schedule="linear", min_lr_ratio=0.0)
    assert [lr_factor(s, lin) for s in (0, 10, 60, 110)] == pytest.approx([0.1, 1.0, 0.5, 0.0])
    const = TrainConfig(steps=110, warmup_steps=0, schedule="constant")
    assert {lr_factor(s, const) for s in (0, 50, 110)} == {1.0}


# --- 6. Medusa: identity init, shared or copied head --------------------------------------------------------


def test_medusa_identity_init_starts_as_the_targets_head():
    t = tiny_target()
    h = make_batch(t, random_sequences(t, 1, 8), (t.num_layers,))["hidden"][t.num_layers]
    want = t.lm_head(h)
    for head in ("shared", "copied"):
        m = Medusa(t, MedusaConfig(num_heads=3, residual_init="identity", head=head))
        assert all(torch.equal(lg, want) for lg in m.head_logits(h))
    default = Medusa(t, MedusaConfig(num_heads=3))  # Medusa-1's code: W = 0 but a random bias, x + SiLU(b)
    assert not torch.allclose(default.head_logits(h)[0], want)
    assert new_drafter("medusa", t, {"num_heads": 2, "per_head_vocab": True}).config.head == "copied"  # old config
    copied = Medusa(t, MedusaConfig(num_heads=2, head="copied"))
    assert copied.config.per_head_vocab and all(p.requires_grad for p in copied.lm_heads.parameters())
    with pytest.raises(ValueError, match="Medusa head 'own' not one of"):
        MedusaConfig(head="own")
    with pytest.raises(ValueError, match="Medusa residual_init 'zero' not one of"):
        MedusaConfig(residual_init="zero")


# --- 7. LayerSkip: the recipe chooses the LoRA rank and layers, or the exits and adapter rank -------------


def test_layerskip_recipe_chooses_rank_and_layers(tmp_path):
    recipe = write_recipe(tmp_path)
    t = tiny_target()
    lora = load_recipe(
        recipe,
        [
            "drafter.layerskip.mode=lora",
            "drafter.layerskip.draft_exit=3",
            "drafter.layerskip.lora_rank=3",
            "drafter.layerskip.lora_layers=[2, 0]",
        ],
    )
    m = LayerSkip(t, lora.drafter.layerskip)
    adapted = {n.split(".")[2] for n, _ in t.model.named_modules() if n.endswith(f"lora_A.{ADAPTER}")}
    assert adapted == {"0", "2"}
    assert {p.shape[0] for n, p in m.lora.named_parameters() if n.endswith("A.weight")} == {3}  # the rank
    heads = load_recipe(
        recipe, ["drafter.layerskip.exits=[1, 3]", "drafter.layerskip.draft_exit=3", "drafter.layerskip.adapter_rank=2"]
    )
    m = LayerSkip(tiny_target(), heads.drafter.layerskip)
    assert sorted(m.exits) == ["1", "3"] and m.exits["3"].down.weight.shape == (2, t.hidden_size)
    with pytest.raises(ValueError, match=r"lora_layers \[3\] must lie in 0..1"):
        LayerSkip(tiny_target(), LayerSkipConfig(mode="lora", draft_exit=2, lora_layers=(3,)))


# --- the levers together, end to end: a tiny EAGLE-3 recipe, killed and resumed exactly --------------------


def test_eagle3_levers_recipe_resumes_exactly(tmp_path, regen, monkeypatch):  # noqa: F811 (the fixture)
    from drafters.serving.export import export

    levers = [
        "drafter.eagle3.ttt_steps=3",
        "drafter.eagle3.step_decay=1.0",
        "drafter.eagle3.noise=gaussian",
        "drafter.eagle3.freeze_head=true",
        "drafter.eagle3.draft_vocab_size=100000",
    ]

    def overrides(name: str) -> list[str]:
        return (
            recipe_overrides(regen, tmp_path / name / "run", "eagle3", steps=6, save_every=2, optimizer="muon") + levers
        )

    full = run(tmp_path / "a", overrides("a"))
    crash_at(monkeypatch, 4)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "b", overrides("b"))
    step_4 = checkpoints(tmp_path / "b/run")[-1]
    assert step_4.name == "step_4" and (step_4 / "optimizer_1.bin").exists()  # Muon's and AdamW's states
    monkeypatch.undo()  # the crash hook off: resume
    resumed = run(tmp_path / "b", overrides("b"))

    rows = [[json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()] for d in (full, resumed)]
    steps = [[r for r in rs if "loss" in r] for rs in rows]
    assert [r["step"] for r in steps[1]] == list(range(1, 7))
    assert [r["loss"] for r in steps[0]] == [r["loss"] for r in steps[1]]  # same seed, and the resume, exact
    for r in steps[0]:  # equal step weights: the loss is the plain sum of the three steps' CE
        assert r["train/loss"] == pytest.approx(sum(r[f"train/ce_{k}"] for k in (1, 2, 3)), rel=1e-5)
    a, b = (load_file(str(full / "export/model.safetensors")), load_file(str(resumed / "export/model.safetensors")))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    target = Target.load(REPO / "recipes/targets/stories260K")
    assert torch.equal(a["lm_head.weight"], target.lm_head.weight)  # the full vocabulary's rows, frozen
    assert torch.equal(a["norm.weight"], target.norm.weight)
    config = json.loads((full / "export/config.json").read_text())
    assert config["config"]["draft_vocab_size"] == target.vocab_size
    out = export(full, "eagle3", tmp_path / "engine")
    assert not {"d2t", "t2d"} & set(load_file(str(out / "model.safetensors")))  # full vocabulary: no mapping
