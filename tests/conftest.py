"""Shared fixtures: tiny random Qwen3 and Llama targets (fp32, eager and sdpa) and the bundled real target."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
torch.set_num_threads(1)  # tiny models: threads only add sync overhead (10x slower on a busy machine)

REPO = Path(__file__).resolve().parents[1]
REAL_HOME = Path(os.environ.get("DRAFTSMITH_HOME") or Path.home() / ".cache" / "draftsmith")  # before the fixture


@pytest.fixture(scope="session", autouse=True)
def data_home(tmp_path_factory):
    """Regenerated data and feature caches of every test (and its subprocesses) go to a fresh tmp dir,
    never to the user's ~/.cache/draftsmith/data."""
    d = tmp_path_factory.mktemp("data_home")
    os.environ["DRAFTSMITH_DATA"] = str(d)
    # and no vLLM side venv: `engine: auto` behaves as on a fresh machine (CI runs where a user may have
    # built one); the slow engine-check test points back at REAL_HOME itself
    os.environ["DRAFTSMITH_HOME"] = str(tmp_path_factory.mktemp("draftsmith_home"))
    return d


STORIES = REPO / "recipes" / "targets" / "stories260K"
STORIES_QWEN3 = REPO / "recipes" / "targets" / "stories-qwen3"  # a Qwen3 distilled from it (its README says how)
DEV_PROMPTS = REPO / "recipes" / "prompts" / "stories_dev.txt"


def tiny_model(
    family: str = "qwen3", attn: str = "eager", layers: int = 4, vocab: int = 128, seed: int = 0, hidden: int = 32
):
    """A random decoder-only LM with the standard HF layout, small enough for a test."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        attn_implementation=attn,
    )
    if family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(tie_word_embeddings=False, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True, **common))
    return model.eval().requires_grad_(False)


def tiny_target(family: str = "qwen3", attn: str = "eager", **kw):
    from decode.target import Target

    return Target(tiny_model(family, attn, **kw))


@pytest.fixture(params=[("qwen3", "eager"), ("llama", "sdpa")], ids=lambda p: f"{p[0]}-{p[1]}")
def tiny(request):
    """A tiny random target: Qwen3 with eager attention and Llama with sdpa."""
    return tiny_target(*request.param)


@pytest.fixture(scope="session")
def stories():
    """The bundled real target (Karpathy's stories260K)."""
    from decode.target import Target

    return Target.load(STORIES)


@pytest.fixture(scope="session")
def stories_qwen3():
    """The bundled real Qwen3-architecture target (QK-norm): stories260K distilled into a Qwen3."""
    from decode.target import Target

    return Target.load(STORIES_QWEN3)
