"""Distil the bundled story target (stories260K, a Llama) into a small Qwen3: a real, trained Qwen3-architecture
target (QK-norm in every layer) for the fast suite and the benches, since no real Qwen3 fits these machines.

    python scripts/distill_story_qwen3.py [--out recipes/targets/stories-qwen3] [--steps 1500] [--threads 2]

1. The teacher samples `--samples` stories from BOS (T = 1, `--length` tokens each; the same data regime as the
   story recipes' self-distillation).
2. A Qwen3 student (hidden 128, 4 heads of 32 so vLLM's CPU attention runs it, 2 kv heads, `--layers` layers,
   vocab 512, untied head like Qwen3-14B) learns the teacher's whole next-token distribution on them (forward KL).
3. Held-out KL and top-1 agreement with the teacher are printed as it trains and written into the model card;
   the directory is written whole into a temporary folder and then moved into place.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
STORIES = REPO / "recipes" / "targets" / "stories260K"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")


def story_qwen3_config(layers: int = 8, hidden: int = 128):
    """A Qwen3 config on the stories vocabulary: head_dim 32 (vLLM's CPU minimum), 2 kv heads, untied head."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=max(1, hidden // 64),
        head_dim=32,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )


@torch.no_grad()
def sample_stories(teacher, n: int, length: int, batch: int, seed: int) -> torch.Tensor:
    """[n, length] stories the teacher samples from BOS at T = 1."""
    torch.manual_seed(seed)
    rows = []
    for _ in tqdm(range(0, n, batch), desc="teacher samples", unit="batch"):
        bos = torch.ones(batch, 1, dtype=torch.long)
        rows.append(
            teacher.generate(
                bos,
                attention_mask=torch.ones_like(bos),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_length=length,  # BOS + length - 1 sampled tokens
                min_length=length,
                pad_token_id=0,
            )
        )
    return torch.cat(rows)[:n]


def distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Forward KL(teacher || student) per position, averaged; both [B, T, V]."""
    t = F.log_softmax(teacher_logits.float(), -1)
    s = F.log_softmax(student_logits.float(), -1)
    return (t.exp() * (t - s)).sum(-1).mean()


@torch.no_grad()
def held_out(student, teacher, ids: torch.Tensor) -> tuple[float, float]:
    """(KL, top-1 agreement) of the student against the teacher on [N, T] held-out stories."""
    kl, agree = [], []
    for chunk in ids.split(64):
        s, t = student(chunk).logits, teacher(chunk).logits
        kl.append(distill_loss(s, t).item())
        agree.append((s.argmax(-1) == t.argmax(-1)).float().mean().item())
    return sum(kl) / len(kl), sum(agree) / len(agree)


CARD = """# stories-qwen3: a Qwen3 distilled from stories260K

A small **Qwen3-architecture** target (`Qwen3ForCausalLM`: QK-norm in every layer, untied LM head) for the fast
suite and the benches, made because no real Qwen3 fits these machines. It speaks stories260K's language: it was
trained only to match the bundled `stories260K` (Llama) next-token distribution on stories that model sampled.

- made by `python scripts/distill_story_qwen3.py {args}` ({minutes:.1f} min on {threads} CPU threads)
- {params:,} params; vocab 512 (the stories260K tokenizer, copied), hidden {hidden}, {layers} layers, {heads} heads of
  32 (vLLM's CPU attention minimum), {kv} kv heads, ffn {ffn}; bos=1, eos=2; weights stored in bf16, loaded as fp32
- data: {samples:,} stories of {length} tokens sampled by stories260K from BOS at T = 1 (seed {seed}), {held} held out
- held-out against the teacher (fp32, before rounding): KL {kl:.4f} nats/token, top-1 agreement {agree:.3f} (start: KL {kl0:.3f})
- licence: MIT, as stories260K's weights and tokenizer
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "recipes/targets/stories-qwen3"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--samples", type=int, default=8192)
    ap.add_argument("--held-out", type=int, default=256)
    ap.add_argument("--length", type=int, default=160)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"error: {out} exists and is not empty; remove it or pass another --out")
    if args.hidden % 64:
        raise SystemExit(f"error: --hidden {args.hidden} must be a multiple of 64 (heads of 32, half as many kv heads)")
    torch.set_num_threads(args.threads)
    t0 = time.time()

    # 1. The teacher's stories.
    from transformers import LlamaForCausalLM, Qwen3ForCausalLM

    teacher = LlamaForCausalLM.from_pretrained(STORIES, torch_dtype=torch.float32).eval()
    n = args.samples + args.held_out
    ids = sample_stories(teacher, n, args.length, min(256, n), args.seed)
    train_ids, eval_ids = ids[: args.samples], ids[args.samples :]

    # 2. The student, trained on the teacher's distributions (cosine schedule after a short warmup).
    torch.manual_seed(args.seed)
    cfg = story_qwen3_config(args.layers, args.hidden)
    student = Qwen3ForCausalLM(cfg)
    opt = torch.optim.AdamW(student.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    warm = max(1, args.steps // 30)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))
    )
    kl0, _ = held_out(student.eval(), teacher, eval_ids)
    gen = torch.Generator().manual_seed(args.seed)
    bar = tqdm(range(args.steps), desc="distil", unit="step")
    for step in bar:
        student.train()
        batch = train_ids[torch.randint(0, len(train_ids), (args.batch_size,), generator=gen)]  # [B, T]
        with torch.no_grad():
            t_logits = teacher(batch).logits
        loss = distill_loss(student(batch).logits, t_logits)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        sched.step()
        bar.set_postfix(kl=f"{loss.item():.4f}")
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            kl, agree = held_out(student.eval(), teacher, eval_ids)
            tqdm.write(f"step {step + 1}: held-out KL {kl:.4f}, top-1 agreement {agree:.3f}")

    # 3. Write the directory whole, then move it into place.
    kl, agree = held_out(student.eval(), teacher, eval_ids)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".stories-qwen3-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; a target directory is read by everyone
    student.save_pretrained(tmp, safe_serialization=True)
    # 3a. Weights stored in bf16 (half the bytes; config.json stays float32, so they load as fp32): rounding moved
    # the held-out KL by < 1e-4 when measured.
    state = load_file(str(tmp / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, str(tmp / "model.safetensors"), {"format": "pt"})
    for f in TOKENIZER_FILES:
        shutil.copy2(STORIES / f, tmp / f)
    shutil.copy2(STORIES / "LICENSE", tmp / "LICENSE")
    shown = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("out", "threads"))
    (tmp / "README.md").write_text(
        CARD.format(
            args=shown,
            minutes=(time.time() - t0) / 60,
            threads=args.threads,
            params=sum(p.numel() for p in student.parameters()),
            hidden=cfg.hidden_size,
            layers=cfg.num_hidden_layers,
            heads=cfg.num_attention_heads,
            kv=cfg.num_key_value_heads,
            ffn=cfg.intermediate_size,
            samples=args.samples,
            length=args.length,
            seed=args.seed,
            held=args.held_out,
            kl=kl,
            agree=agree,
            kl0=kl0,
        )
    )
    (tmp / "distill.json").write_text(
        json.dumps(
            {"args": {k: v for k, v in vars(args).items() if k != "out"}, "held_out_kl": kl, "top1_agreement": agree}
        )
    )
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    print(f"wrote {out}: held-out KL {kl:.4f}, top-1 agreement {agree:.3f}, {(time.time() - t0) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
