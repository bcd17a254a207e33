"""EAGLE-3 draft-vocabulary coverage: the share of trained (assistant) tokens the N most frequent tokens cover.

The draft vocabulary is chosen from token counts on the training split (drafters/trainable/eagle3.py
`build_draft_vocab`, train/__main__.py `token_counts`); what matters is how much of *unseen*
assistant text it covers, since a token outside it can never be drafted. So: count on the first
(1 - held_out) of the conversations, measure coverage on the rest, for several sizes N.

    python scripts/draft_vocab_coverage.py [--target DIR] [--source FILE_OR_DIR ...] [--n 2000] \
        [--sizes 2048 4096 8192 16384 32768]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from decode.loading import load_tokenizer
from train.data.identity import data_home
from train.data.sources import DataConfig, load_records

REPO = Path(__file__).resolve().parents[1]


def coverage(train_counts: torch.Tensor, held_counts: torch.Tensor, n: int) -> float:
    """Share of held-out token occurrences whose token is among the n most frequent training tokens."""
    top = torch.topk(train_counts, min(n, train_counts.numel())).indices
    return float(held_counts[top].sum() / held_counts.sum().clamp(min=1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(REPO / "recipes/targets/smollm2-135m-instruct"))
    ap.add_argument("--source", nargs="+", default=None, help="default: $DRAFTSMITH_DATA/sharegpt/sharegpt.jsonl")
    ap.add_argument("--n", type=int, default=2000, help="conversations read")
    ap.add_argument("--held-out", type=float, default=0.2)
    ap.add_argument("--max-length", type=int, default=1024, help="tokens counted per answer")
    ap.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    args = ap.parse_args(argv)
    tok = load_tokenizer(args.target)
    cfg = DataConfig(source=args.source or [str(data_home() / "sharegpt" / "sharegpt.jsonl")], max_records=args.n)
    records = load_records(cfg)
    # assistant messages tokenized on their own (the trained tokens, without the template's few
    # header tokens): one batched fast-tokenizer call instead of a template render per turn
    answers = [[m["content"] for m in r["messages"] if m["role"] == "assistant"] for r in records]
    cut = int(len(answers) * (1 - args.held_out))
    V = len(tok)
    counts = []
    for part in (answers[:cut], answers[cut:]):
        texts = [a for conv in part for a in conv]
        c = torch.zeros(V, dtype=torch.long)
        for ids in tok(texts, add_special_tokens=False)["input_ids"]:
            c += torch.bincount(torch.tensor(ids[: args.max_length], dtype=torch.long), minlength=V)
        counts.append(c)
    seqs = answers
    print(
        f"{args.target}: vocabulary {V}; counted on {cut} conversations ({int(counts[0].sum())} assistant tokens), "
        f"coverage measured on {len(seqs) - cut} held-out ones ({int(counts[1].sum())} assistant tokens); "
        f"{int((counts[0] > 0).sum())} distinct tokens seen in training"
    )
    print(f"{'draft vocab':>11} {'held-out coverage':>18} {'train coverage':>15}")
    for n in args.sizes:
        print(f"{n:>11} {coverage(counts[0], counts[1], n):>18.4f} {coverage(counts[0], counts[0], n):>15.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
