"""The scripts' smoke tests use the tiny chat target of the data tests (a ChatML tokenizer, random Qwen3)."""

from tests.train.conftest import chat_target_dir, chatml  # noqa: F401 - fixtures, found by name
