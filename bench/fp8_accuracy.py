"""FP8 against bf16 on the same random model: the next-token distribution at every position of one
random prompt, from the bf16 weights and from the same weights quantized to block FP8 at load.

    python -m deltaserve.bench.fp8_accuracy --preset qwen3_5_35b_a3b --tokens 1000 --decode 64 --json out.json

Positions 0 .. tokens - decode - 1 come from one prefill pass (FP8: activations quantized per
1 x 128 group, the tensor-core path); the last `decode` positions one token a pass (FP8: the decode
GEMVs, activations as they are). Per part: top-1 agreement of the next token and the mean KL
divergence KL(bf16 || fp8) of the next-token distributions (float32 softmax of each model's
logits). The models load one after the other (one GPU holds either).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from deltaserve.layers.config import ModelConfig
from deltaserve.layers.loader import load_model
from deltaserve.workers.context import build_forward_context, logits_rows
from deltaserve.workers.plan import PassPlan, PoolSizes
from deltaserve.workers.state_pool import StatePool

from .presets import PRESETS, preset_config


def _pass(model, pool, ids: list[int], start: int, block_size: int, pass_id: int, device: str) -> torch.Tensor:
    """One pass of tokens ids (positions start ..) of the one sequence (pages 1.., slot 0): the
    logits of every token, float32 [len(ids), V]."""
    end = start + len(ids)
    pages = list(range(1, -(-end // block_size) + 1))
    plan = PassPlan(
        pass_id=pass_id,
        req_ids=["a"],
        num_decode_rows=1 if (len(ids) == 1 and start > 0) else 0,
        input_ids=np.array(ids, np.int32),
        positions=np.arange(start, end, dtype=np.int32),
        slot_mapping=np.array([pages[p // block_size] * block_size + p % block_size for p in range(start, end)]),
        query_start_loc=np.array([0, len(ids)], np.int32),
        seq_lens=np.array([end], np.int32),
        block_tables=np.array([pages], np.int32),
        state_slots=np.array([0], np.int32),
        has_initial_state=np.array([start > 0], bool),
        sample_rows=np.ones(1, bool),
        prompt_logprob_rows=np.ones(1, bool),
    )
    indices, _ = logits_rows(plan)
    ctx = build_forward_context(plan, model.config, model.layout, device, indices)
    with torch.inference_mode():
        hidden = model(ctx, pool.layer_states)
        return model.compute_logits(hidden[ctx.logits_indices]).float()


def run_model(
    config: ModelConfig, quantization: str | None, ids: list[int], decode: int, seed: int, device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
) -> dict:  # fmt: skip
    """Logits of the prompt's positions (prefill part, then one token a pass), on the CPU."""
    t0 = time.perf_counter()
    model = load_model(None, config=config, dtype=dtype, device=device, load_format="random", seed=seed,
                       quantization=quantization)  # fmt: skip
    load_s = time.perf_counter() - t0
    block_size = 16
    sizes = PoolSizes(num_blocks=-(-len(ids) // block_size) + 2, block_size=block_size, num_slots=2)
    pool = StatePool(model, sizes, dtype=dtype, device=device)
    head = len(ids) - decode
    parts = [_pass(model, pool, ids[:head], 0, block_size, 0, device).cpu()]
    for i in range(head, len(ids)):
        parts.append(_pass(model, pool, ids[i : i + 1], i, block_size, 1 + i, device).cpu())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    del model, pool
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"logits": torch.cat(parts), "load_s": load_s, "weight_bytes": weight_bytes}


def compare(ref: torch.Tensor, ours: torch.Tensor) -> dict:
    """Top-1 agreement and mean KL(ref || ours) over rows of logits."""
    logp_ref, logp = ref.log_softmax(-1), ours.log_softmax(-1)
    kl = (logp_ref.exp() * (logp_ref - logp)).sum(-1)
    return {
        "positions": int(ref.shape[0]),
        "top1_agreement": (ref.argmax(-1) == ours.argmax(-1)).float().mean().item(),
        "mean_kl": kl.mean().item(),
        "max_kl": kl.max().item(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3_5_35b_a3b", choices=PRESETS)
    p.add_argument("--tokens", type=int, default=1000, help="prompt positions compared")
    p.add_argument("--decode", type=int, default=64, help="of them, the last ones run one token a pass")
    p.add_argument("--seed", type=int, default=0, help="of the random weights and the prompt")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("fp8_accuracy needs a CUDA device")
        return 2
    config = preset_config(args.preset)
    rng = np.random.default_rng(args.seed)
    ids = rng.integers(10, config.vocab_size - 10, args.tokens).tolist()
    bf16 = run_model(config, None, ids, args.decode, args.seed)
    fp8 = run_model(config, "fp8", ids, args.decode, args.seed)
    head = args.tokens - args.decode
    report = {
        "device": torch.cuda.get_device_name(),
        "preset": args.preset,
        "weight_bytes": {"bf16": bf16["weight_bytes"], "fp8": fp8["weight_bytes"]},
        "prefill": compare(bf16["logits"][:head], fp8["logits"][:head]),
        "decode": compare(bf16["logits"][head:], fp8["logits"][head:]),
        "all": compare(bf16["logits"], fp8["logits"]),
    }
    for part in ("prefill", "decode", "all"):
        r = report[part]
        print(
            f"{part:>7}: {r['positions']} positions, top-1 agreement {100 * r['top1_agreement']:.1f}%, "
            f"mean KL {r['mean_kl']:.3e} (max {r['max_kl']:.3e})"
        )
    print(f"weights: bf16 {bf16['weight_bytes'] / 1e9:.1f} GB, fp8 {fp8['weight_bytes'] / 1e9:.1f} GB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
