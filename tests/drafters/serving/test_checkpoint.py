"""Native checkpoints: save -> load gives identical drafts, wrong targets and tampered files are refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from decode.generate import generate
from decode.tree import Shape
from drafters.registry import make_drafter
from drafters.serving import checkpoint
from drafters.serving.checkpoint import load_drafter, save_drafter
from tests.conftest import tiny_target
from tests.drafters.batches import KINDS, build, make_batch, record_rounds

PROMPT = torch.tensor([1, 5, 9, 33, 17, 4, 60])


def drafts(module, target, shape: Shape) -> list[list[int]]:
    d = module.drafter()
    rounds = record_rounds(d)
    generate(target, d, PROMPT, 12, shape=shape)
    return [t.tokens.tolist() for t in rounds]


@pytest.mark.parametrize("kind", KINDS)
def test_save_load_gives_identical_drafts(tmp_path, kind):
    target = tiny_target("qwen3", seed=3)
    m = build(kind, target)
    out = save_drafter(m, tmp_path / "export", recipe={"lr": 1e-3}, target_id="tiny")
    meta = json.loads((out / "config.json").read_text())
    assert meta["draftsmith_drafter"] == m.kind and meta["recipe"] == {"lr": 1e-3}
    assert meta["target"]["name_or_path"] == "tiny"
    assert meta["target"]["fingerprint"]["hidden_size"] == target.hidden_size
    keys = set(load_file(str(out / "model.safetensors")))
    assert keys and not any("embed_tokens" in k or k.startswith("model.") for k in keys)
    assert "lm_head.weight" not in keys or m.kind == "eagle3"  # EAGLE-3's own draft-vocabulary head
    fresh = tiny_target("qwen3", seed=3)  # the same target weights, loaded anew
    loaded = load_drafter(out, fresh)
    for k, v in m.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    for shape in (Shape("chain", k=3), Shape("dynamic", topk=3, depth=3, nodes=8)):
        assert drafts(m, target, shape) == drafts(loaded, fresh, shape)


def test_eagle3_config_records_capture_ids_and_vocab(tmp_path):
    m = build("eagle3", tiny_target("llama"))
    meta = json.loads((save_drafter(m, tmp_path / "e3") / "config.json").read_text())
    assert meta["capture_ids"] == list(m.config.capture_ids)
    assert meta["draft_vocab_size"] == m.config.draft_vocab_size == 64


def test_lora_adapter_dir_is_a_standard_peft_adapter(tmp_path):
    from peft import PeftModel

    from decode.target import Target

    target = tiny_target("llama", seed=2)
    m = build("layerskip-lora", target)
    out = save_drafter(m, tmp_path / "ls")
    assert (out / "adapter" / "adapter_config.json").is_file()
    assert all(k.startswith("base_model.model.") for k in load_file(str(out / "adapter" / "adapter_model.safetensors")))
    peft_model = PeftModel.from_pretrained(tiny_target("llama", seed=2).model, str(out / "adapter"))
    ids = PROMPT.view(1, -1)
    with torch.no_grad(), m.adapters_on():
        ours = Target(target.model).forward(PROMPT, None).logits
    assert torch.allclose(peft_model(input_ids=ids).logits[0], ours, atol=1e-5)


def test_registry_loads_a_native_directory(tmp_path):
    from drafters.sources.ar import ARDrafter

    target = tiny_target("qwen3")
    out = save_drafter(build("eagle3", target), tmp_path / "run" / "export")
    d = make_drafter(str(out), target)
    assert d.name == str(out) and d.hidden_ids == tuple(json.loads((out / "config.json").read_text())["capture_ids"])
    assert generate(target, d, PROMPT, 12).tokens == generate(target, ARDrafter(), PROMPT, 12).tokens
    with pytest.raises(ValueError, match="not a drafter checkpoint"):
        make_drafter(str(tmp_path), target)


@pytest.mark.parametrize("kind", KINDS)
def test_a_bf16_target_drafts_in_bf16_and_stays_lossless(tmp_path, kind):
    """A float32 module on a bf16 target made every draft step a float32 matmul (the chat target's 16k-row
    draft head: 6.2 vs 1.1 ms); loaded for decoding it takes the target's dtype, and a float32 target keeps
    a float32 drafter. Either way the greedy output is the target's own."""
    from decode.target import Target
    from drafters.sources.ar import ARDrafter
    from tests.conftest import tiny_model

    out = save_drafter(build(kind, tiny_target("qwen3", seed=3)), tmp_path / "export")
    for dtype in (torch.bfloat16, torch.float32):
        target = Target(tiny_model("qwen3", seed=3).to(dtype))
        d = make_drafter(str(out), target)
        module = getattr(d, "m", None)
        if module is not None:  # EAGLE and Medusa drafters hold their module
            assert {p.dtype for p in module.parameters()} == {dtype}
        assert generate(target, d, PROMPT, 12).tokens == generate(target, ARDrafter(), PROMPT, 12).tokens


def test_one_lora_directory_gives_several_drafters_on_one_target(tmp_path):
    """A benchmark makes a chain, a tree and an auto row of one LayerSkip-LoRA directory on one target: the
    second load reuses the adapters already injected (it raised 'already carries peft adapters'), each drafter
    drafts what a drafter of its own would; another LoRA directory on that target is still refused."""
    from drafters.sources.ar import ARDrafter

    source = tiny_target("qwen3", seed=3)
    module = build("layerskip-lora", source)
    out = save_drafter(module, tmp_path / "ls")
    other = save_drafter(build("layerskip-lora", tiny_target("qwen3", seed=3)), tmp_path / "ls2")
    target = tiny_target("qwen3", seed=3)
    first, second = make_drafter(str(out), target), make_drafter(str(out), target)
    assert first is not second
    shape = Shape("dynamic", topk=3, depth=3, nodes=8)
    own = drafts(module, source, shape)
    for d in (first, second):
        rounds = record_rounds(d)
        assert generate(target, d, PROMPT, 12, shape=shape).tokens == generate(target, ARDrafter(), PROMPT, 12).tokens
        assert [t.tokens.tolist() for t in rounds] == own
    with pytest.raises(ValueError, match="already carries peft adapters"):
        make_drafter(str(other), target)


def test_wrong_target_is_refused(tmp_path):
    out = save_drafter(build("medusa", tiny_target("qwen3")), tmp_path / "m")
    with pytest.raises(ValueError, match="hidden_size: drafter trained for 32, target has 48"):
        load_drafter(out, tiny_target("qwen3", hidden=48))
    with pytest.raises(ValueError, match="num_hidden_layers"):
        load_drafter(out, tiny_target("qwen3", layers=3))
    with pytest.raises(ValueError, match="vocab_size"):
        load_drafter(out, tiny_target("qwen3", vocab=96))


@pytest.mark.parametrize("tamper", ["extra", "missing", "shape"])
def test_tampered_weights_are_refused(tmp_path, tamper):
    target = tiny_target("qwen3")
    out = save_drafter(build("eagle3", target), tmp_path / "e")
    state = load_file(str(out / "model.safetensors"))
    if tamper == "extra":
        state["embed_tokens.weight"] = torch.zeros(2, 2)
        match = "unexpected.*embed_tokens.weight"
    elif tamper == "missing":
        del state["midlayer.hidden_norm.weight"]
        match = "missing.*midlayer.hidden_norm.weight"
    else:
        state["fc.weight"] = torch.zeros(3, 3)
        match = "fc.weight"
    save_file(state, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match=match):
        load_drafter(out, target)


def test_unknown_config_key_is_refused(tmp_path):
    target = tiny_target("qwen3")
    out = save_drafter(build("medusa", target), tmp_path / "m")
    meta = json.loads((out / "config.json").read_text())
    meta["config"]["num_haeds"] = 3
    (out / "config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="unknown keys \\['num_haeds'\\]"):
        load_drafter(out, target)


def test_save_is_atomic(tmp_path, monkeypatch):
    target = tiny_target("qwen3")
    m = build("medusa", target)
    out = save_drafter(m, tmp_path / "export")
    before = (out / "model.safetensors").read_bytes()
    save_drafter(m, tmp_path / "export")  # overwriting works and leaves nothing behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "save_file", broken)
    with torch.no_grad():
        m.blocks[0].layers[0].bias.add_(1.0)
    with pytest.raises(OSError, match="disk full"):
        save_drafter(m, tmp_path / "export")
    assert (out / "model.safetensors").read_bytes() == before  # the old checkpoint is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_new_drafter_from_a_recipe_dict():
    from drafters.serving.checkpoint import new_drafter

    target = tiny_target("qwen3")
    m = new_drafter("medusa", target, {"num_heads": 2, "loss": "kl"})
    assert m.kind == "medusa" and m.config.num_heads == 2
    with pytest.raises(ValueError, match="unknown keys"):
        new_drafter("eagle3", target, {"capture_layers": [1, 2, 3]})
    with pytest.raises(ValueError, match="not one of"):
        new_drafter("eagle4", target)


@pytest.mark.parametrize("kind", ["eagle3", "layerskip-lora"])
def test_load_weights_into_the_live_module_resumes(tmp_path, kind):
    """Resuming loads into the module the run already has (a LoRA drafter cannot be injected twice)."""
    from drafters.serving.checkpoint import load_weights

    target = tiny_target("qwen3")
    m = build(kind, target)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    out = save_drafter(m, tmp_path / "ckpt")
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)
    load_weights(m, out)
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in before.items())


def test_training_checkpoint_resumes_without_unpickling_objects(tmp_path, monkeypatch):
    """The loop's checkpoints/step_N (accelerate save_state): weights as safetensors, the rest (optimizer,
    scheduler, RNG) loaded back only with torch.load(weights_only=True), which rebuilds no arbitrary object."""
    from train.distributed import make_accelerator
    from train.loop import LossModule, TrainConfig

    target = tiny_target("qwen3")
    m = build("medusa", target)
    acc = make_accelerator(TrainConfig(report_to="none"), tmp_path)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model, opt, sched = acc.prepare(LossModule(m), opt, sched)
    ids = torch.randint(3, target.vocab_size, (2, 12))
    loss, _ = model(make_batch(target, ids, m.feature_ids()), 0)
    acc.backward(loss)
    opt.step()
    acc.save_state(str(tmp_path / "step_1"))
    files = sorted(p.name for p in (tmp_path / "step_1").iterdir())
    assert "model.safetensors" in files and not any(f.startswith("pytorch_model") for f in files), files

    calls = []
    real = torch.load

    def recording_load(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", recording_load)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)
    acc.load_state(str(tmp_path / "step_1"))
    assert len(calls) >= 3 and all(w is True for w in calls), calls  # optimizer, scheduler, RNG: weights_only loads
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in before.items())
    acc.end_training()
