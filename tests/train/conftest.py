"""Fixtures for the data/features tests: a small ChatML tokenizer (Qwen3-like template with a <think>
block, byte-level BPE trained on the bundled MT-bench questions) and a tiny random Qwen3 target using it."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "tests" / "data" / "chatml_template.jinja"
MT_BENCH = REPO / "recipes" / "data" / "mt_bench_question.jsonl"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def chatml_tokenizer(vocab_size: int = 384):
    """A byte-level BPE tokenizer with Qwen3's special tokens and a Qwen3-like chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    text = [t for line in MT_BENCH.read_text().splitlines() for t in json.loads(line)["turns"]]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tk.train_from_iterator(text, trainer)
    # Qwen3: <think> and </think> are added tokens that are not "special" (they survive skip_special_tokens).
    tk.add_tokens(
        [
            AddedToken("<think>", normalized=False, special=False),
            AddedToken("</think>", normalized=False, special=False),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=TEMPLATE.read_text()
    )


@pytest.fixture(scope="session")
def chatml():
    return chatml_tokenizer()


@pytest.fixture(scope="session")
def chat_target_dir(tmp_path_factory, chatml):
    """A saved tiny random Qwen3 model + the ChatML tokenizer (EOS = <|im_end|>), loadable by Target.load."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=len(chatml),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=1024,
        eos_token_id=chatml.eos_token_id,
        pad_token_id=chatml.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    d = tmp_path_factory.mktemp("chat_target")
    Qwen3ForCausalLM(cfg).save_pretrained(d)
    chatml.save_pretrained(d)
    return d


@contextlib.contextmanager
def single_thread():
    """These tests run many tiny ops: with 2 threads on a busy 2-core machine OpenMP's spin-waiting made
    them ~30x slower (measured: extraction 35 s vs 1 s), so they run single-threaded."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def one_thread():
    with single_thread():
        yield


@pytest.fixture(scope="session")
def threads1():
    """`single_thread` for fixtures of pytest's widest scope (set up before the autouse one applies)."""
    return single_thread
