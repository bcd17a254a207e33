"""Memory and time estimates for training each drafter kind on a target, from sizes alone (no weights).

Builds the target and every drafter on the meta device from a config.json and prints parameter
counts, training memory per process and the compute per training token. These are *estimates*:
activations are approximated and the time assumes a stated fraction of peak throughput.

    python scripts/estimate.py --config recipes/data/qwen3-14b-config.json --seq 2048 --batch 1
"""

from __future__ import annotations

import argparse
import json

import torch

GiB = 1024**3


def build(config_path: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    from decode.target import Target

    cfg = AutoConfig.for_model(**{k: v for k, v in json.load(open(config_path)).items() if k != "architectures"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return Target(model)


def drafters(target) -> dict[str, torch.nn.Module]:
    from drafters.trainable.dflash import DFlash, DFlashConfig
    from drafters.trainable.dspark import DSpark, DSparkConfig
    from drafters.trainable.eagle import Eagle1
    from drafters.trainable.eagle3 import Eagle3
    from drafters.trainable.layerskip import LayerSkip, LayerSkipConfig
    from drafters.trainable.medusa import Medusa

    L = target.num_layers  # the drafters follow the target's (meta) device
    return {
        "eagle3": Eagle3(target),
        "eagle1": Eagle1(target),
        "medusa": Medusa(target),
        "layerskip": LayerSkip(
            target, LayerSkipConfig(draft_exit=L // 5, exits=tuple(range(2, L, 2)), adapter_rank=64)
        ),
        # DeepSpec's block drafters: 5 draft layers over 5 capture layers spread 1 + 9k (hidden ids: layer + 1)
        "dflash": DFlash(target, DFlashConfig(num_layers=5, capture_ids=block_ids(L))),
        "dspark": DSpark(target, DSparkConfig(num_layers=5, capture_ids=block_ids(L))),
    }


def block_ids(num_layers: int) -> tuple[int, ...]:
    """Five capture ids spread like DeepSpec's [1, 10, 19, 28, 37] for 40 layers, as hidden ids (layer + 1)."""
    step = (num_layers - 4) // 4
    return tuple(2 + step * i for i in range(5))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="recipes/data/qwen3-14b-config.json")
    ap.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    ap.add_argument("--batch", type=int, default=1, help="sequences per GPU micro-batch")
    ap.add_argument("--tokens", type=float, default=68e6, help="training tokens per epoch (68k ShareGPT x ~1k)")
    ap.add_argument("--tflops", type=float, default=989.0, help="peak bf16 TFLOP/s of one accelerator (H100 SXM)")
    ap.add_argument("--mfu", type=float, default=0.35, help="assumed fraction of peak reached")
    args = ap.parse_args()
    target = build(args.config)
    n_target = sum(p.numel() for p in target.model.parameters())
    H, V, L = target.hidden_size, target.vocab_size, target.num_layers
    tokens = args.seq * args.batch
    print(
        f"target: {L} layers, hidden {H}, vocab {V}, {n_target / 1e9:.2f}B params = {2 * n_target / GiB:.1f} GiB bf16"
    )
    print(
        f"(estimates) {args.batch} x {args.seq} tokens per micro-batch; time at {args.mfu:.0%} of {args.tflops:.0f} TFLOP/s"
    )
    print(
        f"{'kind':<10}{'trainable':>12}{'weights+grads+adam':>20}{'logits act.':>13}{'online target':>15}"
        f"{'GFLOP/token':>13}{'GPU-h/epoch online':>20}"
    )
    for kind, mod in drafters(target).items():
        n = sum(p.numel() for p in mod.parameters() if p.requires_grad)
        state = n * (4 + 4 + 8)  # fp32 weights, grads, Adam m and v
        # passes per training token: EAGLE's unrolled steps, Medusa's heads; a block drafter runs each anchor's block
        # once (anchors x block rows per sequence, about the sequence's length at the recipes' 32 x 8 / 2048 tokens)
        steps = getattr(mod.config, "ttt_steps", getattr(mod.config, "num_heads", 1))
        head_rows = getattr(mod.config, "draft_vocab_size", None) or V
        logits = tokens * head_rows * 4 * 2 * min(steps, 2)  # fp32 logits + softmax grad, ~2 live steps
        flops_train = 6 * n * steps  # forward + backward through the drafter, per unrolled step
        flops_target = 2 * n_target  # one frozen target forward per token (online mode)
        gpu_h = args.tokens * (flops_train + flops_target) / (args.tflops * 1e12 * args.mfu) / 3600
        print(
            f"{kind:<10}{n / 1e6:>10.0f}M{state / GiB:>18.1f} G{logits / GiB:>11.1f} G{2 * n_target / GiB:>13.1f} G"
            f"{(flops_train + flops_target) / 1e9:>13.1f}{gpu_h:>20.1f}"
        )


if __name__ == "__main__":
    main()
