"""Streamed targets: accelerate offload reproduces the in-memory output token for token, and really streams."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from accelerate.utils.offload import PrefixedDataset

from decode.costmodel import cost_at, load_curve, measure_pass_cost, save_curve
from decode.generate import encode_prompt, generate, main
from decode.offload import load_target
from decode.passes import forward_tree
from decode.placement import OffloadConfig, OffloadError, empty_model, parse_size, plan_placement
from decode.target import Target
from decode.tree import parse_shape
from drafters.registry import make_drafter, resident_layers
from tests.conftest import STORIES, tiny_model

QWEN3_14B = Path(__file__).resolve().parents[1] / "data" / "qwen3-14b-config.json"


CASES = [("ar", "chain"), ("early-exit:2", "chain"), ("early-exit:2", "dynamic:topk=3,depth=4,nodes=12")]


def tokens(target: Target, spec: str, tree: str, prompt: torch.Tensor, n: int = 24) -> list[int]:
    return generate(target, make_drafter(spec, target), prompt, n, shape=parse_shape(tree, 4)).tokens


def count_weight_reads(monkeypatch) -> list[str]:
    """Every weight an accelerate hook fetches from its offload map (cpu state dict or disk) lands in the list."""
    reads: list[str] = []
    original = PrefixedDataset.__getitem__

    def counted(self, key):
        reads.append(self.prefix + key)
        return original(self, key)

    monkeypatch.setattr(PrefixedDataset, "__getitem__", counted)
    return reads


def assert_streams(target: Target, layers: list[int]) -> None:
    """Streamed layers hold no weights between passes; resident ones, the embeddings and the head do."""
    for i in range(target.num_layers):
        devices = {p.device.type for p in target.layers[i].parameters()}
        assert devices == ({"meta"} if i in layers else {target.device.type}), f"layer {i}: {devices}"
        hooked = any(hasattr(m, "_hf_hook") for m in target.layers[i].modules())
        assert hooked == (i in layers), f"layer {i}: resident layers run without hooks, streamed ones with"
    assert target.lm_head.weight.device.type != "meta" and target.embed_tokens.weight.device.type != "meta"


@pytest.mark.parametrize("family,attn", [("qwen3", "eager"), ("llama", "sdpa")])
def test_disk_offload_matches_in_memory_tiny(tmp_path, family, attn):
    tiny_model(family, attn, layers=4, seed=2).save_pretrained(tmp_path / "model")
    ref = Target.load(tmp_path / "model", attn=attn)
    off = load_target(
        tmp_path / "model",
        attn=attn,
        offload=OffloadConfig("disk", offload_dir=str(tmp_path / "off")),
        resident_layers=2,
    )
    assert off.placement.streamed_layers == [2, 3] and off.placement.resident_layers == [0, 1]
    assert_streams(off, [2, 3])
    torch.manual_seed(0)
    prompt = torch.randint(3, 128, (6,))
    for spec, tree in CASES:
        assert tokens(off, spec, tree, prompt) == tokens(ref, spec, tree, prompt), (spec, tree)
    # the KV cache is built from the layers' outputs: on the execution device, every layer filled
    cache = off.new_cache()
    off.prefill(prompt, cache)
    assert {k.device for k in cache.keys} == {off.device} and cache.lens == [6] * 4


@pytest.mark.parametrize("mode", ["disk", "cpu"])
def test_bundled_target_offload_matches_and_drafting_never_streams(stories, tmp_path, monkeypatch, mode):
    off = load_target(STORIES, offload=OffloadConfig(mode, offload_dir=str(tmp_path / "off")), resident_layers=2)
    assert_streams(off, [2, 3, 4])
    prompt = encode_prompt(stories, "Once upon a time, there was a")
    for spec, tree in CASES:
        assert tokens(off, spec, tree, prompt, 32) == tokens(stories, spec, tree, prompt, 32), (spec, tree)

    # early-exit:2 drafting reads no streamed weight; each target pass reads every streamed weight once.
    reads = count_weight_reads(monkeypatch)
    drafter = make_drafter("early-exit:2", off)
    from decode.protocol import Budget, TargetStep

    cache = off.new_cache()
    out = off.prefill(prompt, cache)
    per_pass = len(reads)
    assert per_pass == sum(1 for i in (2, 3, 4) for _ in off.layers[i].parameters())
    first = int(out.logits[-1].argmax())
    drafter.begin(prompt, TargetStep(torch.cat([prompt[1:], torch.tensor([first])]), {}, [], prompt.numel(), cache))
    tree = drafter.propose(Budget(parse_shape("chain", 6)))
    assert tree.size == 6 and len(reads) == per_pass, "drafting streamed target weights"
    forward_tree(off, first, tree, cache, reuse=drafter.reuse())
    assert len(reads) == 2 * per_pass
    if mode == "disk":  # cpu_offload hooks a layer on its own, so its keys are layer-relative
        assert {r.split(".")[2] for r in reads} == {"2", "3", "4"}  # model.layers.{i}....


def test_generate_cli_offload_disk_prints_the_same_text(tmp_path, capsys):
    argv = [
        "--target",
        str(STORIES),
        "--prompt",
        "Once upon a time",
        "--max-new-tokens",
        "24",
        "--drafter",
        "early-exit:2",
    ]
    main(argv)
    plain = capsys.readouterr()
    main(argv + ["--offload", "disk", "--offload-dir", str(tmp_path / "off")])
    streamed = capsys.readouterr()
    assert streamed.out == plain.out and len(plain.out) > len("Once upon a time") + 20
    assert "[offload disk]" in streamed.err and "layers 2-4" in streamed.err


def test_unwritable_offload_dir_is_a_clear_error(tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(OffloadError, match="--offload-dir .* is not writable"):
        load_target(STORIES, offload=OffloadConfig("disk", offload_dir=str(tmp_path / "a-file" / "off")))


def test_max_memory_must_hold_the_resident_drafting_layers():
    with pytest.raises(
        OffloadError, match=r"cannot hold the resident drafting set.*layers 0\.\.1.*at least 611\.28 KiB"
    ):
        load_target(STORIES, offload=OffloadConfig("disk", max_memory="500KiB"), resident_layers=2)
    with pytest.raises(OffloadError, match="--offload disk"):
        load_target(STORIES, offload=OffloadConfig("none", max_memory="500KiB"))
    with pytest.raises(OffloadError, match="expected a size"):
        parse_size("lots")
    assert parse_size("8GiB") == 8 << 30 and parse_size("1.5e6") == 1_500_000


def test_budget_keeps_next_layers_resident_in_order(stories):
    model = stories.model
    layer = 181760  # stories260K: one decoder layer in fp32
    p = plan_placement(model, OffloadConfig("cpu", max_memory=str(626_976 + layer + 10)), 2)
    assert p.resident_layers == [0, 1, 2] and p.streamed_layers == [3, 4] and p.streamed_bytes == 2 * layer
    assert p.device_map["lm_head"] == "cpu" and p.device_map["model.layers.3"] == "cpu"
    p = plan_placement(model, OffloadConfig("disk"), 0)
    assert p.resident_layers == [] and p.device_map["model.layers.0"] == "disk"


def test_qwen3_14b_plan_from_sizes():
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(QWEN3_14B)
    h, f, v, hd = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    layer = 2 * (2 * h * q + 2 * h * kv + 3 * h * f + 2 * hd + 2 * h)  # bf16: q,o + k,v + mlp + qk-norms + 2 norms
    base = 2 * (2 * v * h + h)  # untied embeddings and head + final norm
    p = plan_placement(empty_model(QWEN3_14B, "bfloat16"), OffloadConfig("disk", max_memory="8GiB"), 4)
    fits = 4 + (8 * 2**30 - base - 4 * layer) // layer
    assert p.resident_layers == list(range(fits)) and p.streamed_layers == list(range(fits, 40))
    assert p.streamed_bytes == (40 - fits) * layer
    assert 0 <= p.resident_bytes - (base + fits * layer) < 4096  # + the rotary embedding's buffers


def test_resident_layers_from_specs():
    assert resident_layers(["ar", "early-exit:3", "skip:1,2", "early-exit:1"]) == 3
    assert resident_layers(["ar"]) == 0


def test_pass_cost_curve(stories, tmp_path):
    curve = measure_pass_cost(stories, tokens=(1, 8), prefix=8, repeats=1)
    assert sorted(curve) == [1, 8] and all(s > 0 for s in curve.values())
    save_curve(tmp_path / "cost.json", curve, {"target": "stories260K"})
    assert load_curve(tmp_path / "cost.json") == curve
    assert json.loads((tmp_path / "cost.json").read_text())["target"] == "stories260K"
    c = {1: 1.0, 8: 1.7, 32: 4.1}
    assert cost_at(c, 4) == pytest.approx(1.3) and cost_at(c, 64) == pytest.approx(7.3)
    assert cost_at(c, 1) == 1.0 and cost_at(c, 20) == pytest.approx(2.9)
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(ValueError, match="not a pass-cost file"):
        load_curve(tmp_path / "x.json")


def test_costmodel_and_estimate_clis(tmp_path, capsys):
    from decode import costmodel, offload

    costmodel.main(
        [
            "--target",
            str(STORIES),
            "--offload",
            "disk",
            "--offload-dir",
            str(tmp_path / "off"),
            "--resident-layers",
            "2",
            "--tokens",
            "1,4",
            "--repeats",
            "1",
            "--out",
            str(tmp_path / "c.json"),
        ]
    )
    doc = json.loads((tmp_path / "c.json").read_text())
    assert doc["placement"]["streamed_layers"] == [2, 3, 4] and sorted(load_curve(tmp_path / "c.json")) == [1, 4]
    capsys.readouterr()
    offload.main(
        [
            "--config",
            str(QWEN3_14B),
            "--offload",
            "disk",
            "--max-memory",
            "8GiB",
            "--resident-layers",
            "4",
            "--bandwidth",
            "1GB",
        ]
    )
    out = capsys.readouterr().out
    assert "8 of 40 resident, 32 streamed" in out and "| 1GB/s | 21.1 s (estimate) |" in out
    assert (
        offload.main(
            ["--config", str(QWEN3_14B), "--offload", "disk", "--max-memory", "2GiB", "--resident-layers", "4"]
        )
        == 2
    )
    assert "at least 5.36 GiB" in capsys.readouterr().err
