"""The vLLM side of regeneration (`data.regenerate.engine: vllm`), run by the engine's python, never imported.

    ENGINE_PYTHON train/data/vllm_regen_worker.py JOB.json RESULT.json

It must not import draftsmith (the side venv has neither our packages nor our transformers): token ids in,
token ids out — the caller's tokenizer renders the chat template and reads the replies. JOB.json:
`{"target", "dtype", "seed", "max_model_len", "prompts": [[ids]], "max_tokens": [n per prompt],
  "temperature", "top_p", "top_k", "stop_token_ids"}`. One `LLM(seed=seed)` — vLLM's CPU build refuses
per-request seeds ("CPU Generator does not use offset") — and every prompt submitted in one `generate`
call (the engine schedules them itself). RESULT.json: `{"vllm_version", "outputs": [[ids]],
"stop_reasons": [token id | null], "seconds"}`. vLLM spawns worker processes, so the body stays under
`if __name__ == "__main__":`.
"""

from __future__ import annotations

import json
import sys
import time


def sampling_params(job: dict, max_tokens: int):
    """The hf path's sampling settings as vLLM's: temperature 0 = greedy; top_k 0 / top_p 1 = off; only
    our stop ids end a reply (ignore_eos: vLLM's own notion of EOS may differ)."""
    from vllm import SamplingParams

    knobs = {"temperature": job["temperature"], "top_p": job["top_p"]}
    if job["top_k"] > 0:
        knobs["top_k"] = job["top_k"]
    return SamplingParams(
        max_tokens=max_tokens, stop_token_ids=job["stop_token_ids"], ignore_eos=True, detokenize=False, **knobs
    )


def main() -> int:
    job_path, result_path = sys.argv[1], sys.argv[2]
    with open(job_path) as f:
        job = json.load(f)
    import vllm

    llm = vllm.LLM(
        model=job["target"],
        dtype=job["dtype"],
        seed=job["seed"],
        max_model_len=job["max_model_len"],
        enforce_eager=True,
        skip_tokenizer_init=True,
    )
    prompts = [{"prompt_token_ids": ids} for ids in job["prompts"]]
    params = [sampling_params(job, n) for n in job["max_tokens"]]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    reasons = [o.outputs[0].stop_reason for o in outs]
    result = {
        "vllm_version": vllm.__version__,
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
        "stop_reasons": [r if isinstance(r, int) else None for r in reasons],
        "seconds": seconds,
    }
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
