"""The packed runtime (decode.runtime) computes what HF's modules compute, follows weight changes, and steps aside
for what it cannot run (autograd, wrapped projections, other layer families)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from decode import gemm
from decode.passes import forward_tree
from decode.runtime import Packed, PackedLinear, packed_copy, unsupported
from decode.target import Target
from decode.tree import DraftTree
from tests.conftest import tiny_model


def qwen2_with_bias():
    """A tiny random Qwen2: q/k/v projections with biases."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attn_implementation="sdpa",
    )
    model = Qwen2ForCausalLM(cfg).eval().requires_grad_(False)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.bias.normal_()  # random init leaves them zero: make them matter
    return model


def pair(model: nn.Module) -> tuple[Target, Target]:
    return Target(model, runtime="fast"), Target(model, runtime="hf")


def passes(t: Target) -> list[torch.Tensor]:
    """Prefill, one AR step, and a tree pass with captured states: every output a decode round reads."""
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 128, (11,), generator=g)
    cache = t.new_cache()
    with torch.inference_mode():
        pre = t.prefill(prompt, cache, hidden_ids=(1, t.num_layers))
        step = t.forward(torch.tensor([7]), cache)
        tree = DraftTree(tokens=torch.tensor([3, 4, 5, 6]), parents=torch.tensor([-1, 0, 0, 1]))
        out = forward_tree(t, 9, tree, cache, hidden_ids=(2,))
    return [pre.logits, pre.hidden[1], pre.hidden[t.num_layers], step.logits, out.logits, out.hidden[2]]


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2"])
def test_fast_matches_hf(family):
    model = qwen2_with_bias() if family == "qwen2" else tiny_model(family, "sdpa")
    fast, hf = pair(model)
    assert unsupported(fast.layers, fast.config) is None
    for a, b in zip(passes(fast), passes(hf)):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
    assert fast.runtime.packs, "the fast target never packed: the comparison ran HF twice"


def test_repacks_when_a_weight_changes():
    fast, hf = pair(tiny_model("llama", "sdpa"))
    before = passes(fast)[3]
    with torch.no_grad():
        fast.layers[1].mlp.down_proj.weight.mul_(3.0)  # in place: a training step or a merge
    after, ref = passes(fast)[3], passes(hf)[3]
    torch.testing.assert_close(after, ref, atol=2e-5, rtol=1e-4)
    assert not torch.allclose(after, before)


class Wrapped(nn.Module):
    """Stands for a LoRA wrapper: a projection that is not a plain nn.Linear."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base, self.weight = base, base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + 0.5 * x[..., : self.base.out_features]


def test_wrapped_projection_runs_through_hf():
    model = tiny_model("qwen3", "sdpa")
    fast, hf = pair(model)
    passes(fast)  # packed once
    model.model.layers[0].self_attn.q_proj = Wrapped(model.model.layers[0].self_attn.q_proj)
    for a, b in zip(passes(fast), passes(hf)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert "Wrapped" in fast.runtime.note


def test_autograd_runs_through_hf():
    fast, _ = pair(tiny_model("llama", "sdpa"))
    with torch.enable_grad():
        assert fast.fast() is None
    with torch.no_grad():
        assert fast.fast() is fast.runtime


def test_other_families_and_activations_are_refused():
    model = tiny_model("llama", "sdpa")
    model.config.hidden_act = "gelu"
    assert "silu" in unsupported(model.model.layers, model.config)
    fast, hf = pair(model)
    for a, b in zip(passes(fast), passes(hf)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_bad_runtime_name():
    with pytest.raises(ValueError, match="runtime 'compiled' not one of"):
        Target(tiny_model("llama", "sdpa"), runtime="compiled")


def test_packed_layouts_agree(monkeypatch):
    """The aten layouts (bf16, GPUs, CPUs without AVX2) give F.linear's products."""
    monkeypatch.setattr(gemm, "usable", lambda w: False)
    torch.manual_seed(0)
    wide, tall = nn.Linear(8, 40, bias=True), nn.Linear(40, 8, bias=False)
    for lin, transposed in ((wide, True), (tall, False)):
        p = Packed.of([lin], keep_rows=True)
        assert p.transposed is transposed and not p.panels
        for rows in (1, 5):
            x = torch.randn(rows, lin.in_features)
            torch.testing.assert_close(p(x), lin(x), atol=1e-6, rtol=1e-5)


@pytest.mark.skipif(
    gemm.kernel() is None, reason="the AVX2 decode GEMM needs an x86 CPU with AVX2 + FMA and a compiler"
)
@pytest.mark.parametrize("n,k", [(40, 300), (64, 576), (16, 1)])
def test_gemm_kernel_matches_linear(n, k):
    """Every row count the tail logic meets (groups of 6, K slices of 256, N not a multiple of 16), and a row's
    result does not depend on the other rows (the same sums in the same order)."""
    torch.manual_seed(0)
    lin = nn.Linear(k, n, bias=True)
    p = Packed.of([lin])
    assert p.panels == n
    x = torch.randn(13, k)
    for rows in (1, 2, 5, 6, 7, 13):
        torch.testing.assert_close(p(x[:rows]), lin(x[:rows]), atol=1e-5, rtol=1e-5)
        assert torch.equal(p(x[:rows])[0], p(x[:1])[0])
    assert p(x.view(13, 1, k)).shape == (13, 1, n)


def test_packed_copy_leaves_the_module_alone():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(12, 40), nn.SiLU(), nn.Sequential(nn.Linear(40, 7, bias=False)))
    net.frozen = Target(tiny_model("llama", "sdpa"))  # a plain attribute, as a drafter's target: shared
    copy = packed_copy(net)
    assert type(net[0]) is nn.Linear and type(net[2][0]) is nn.Linear
    assert isinstance(copy[0], PackedLinear) and isinstance(copy[2][0], PackedLinear)
    assert copy.frozen is net.frozen and copy[0].weight is net[0].weight
    x = torch.randn(3, 12)
    with torch.no_grad():
        torch.testing.assert_close(copy(x), net(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("argv", [["--threads", "0"], ["--runtime", "compiled"]])
def test_evaluate_refuses_bad_runtime_options(argv, tmp_path, capsys):
    from decode.harness.evaluate import main

    with pytest.raises(SystemExit) as e:
        main(
            ["--target", str(tmp_path), "--drafter", "ar", "--prompts", "p.jsonl", "--out", str(tmp_path / "o"), *argv]
        )
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("python -m decode.evaluate: error: ") and (
        "--threads 0: must be >= 1" in err or "compiled" in err
    )
    assert not (tmp_path / "o").exists()
