"""The decode tests that need a chat template use the tiny chat target of the data tests (ChatML, random Qwen3)."""

from tests.train.conftest import chat_target_dir, chatml  # noqa: F401 - fixtures, found by name
