"""The data side of training: where the examples come from, before any drafter sees them.

fetch (the real chat target and ShareGPT), sources (files -> records -> tokens + loss masks -> split),
pipeline (sources -> regeneration -> tokens -> split, rank 0 first), regen + regen_engines + vllm_regen_worker (the target answers the prompts: self-distillation), tokens (loss masks),
identity (fingerprints of target, tokenizer and data) and home (the data home, `draftsmith data`).
Features of the frozen target and the training loop live one level up, in train/.
"""
