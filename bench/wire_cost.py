"""Cost of the driver/worker codec (workers/wire.py) on real decode plans: encode and decode of a
pass plan and of its output, per batch size, on this machine's CPU.

    python -m deltaserve.bench.wire_cost [--batch-sizes 1,64,256] [--context 300]

Builds the built-in demo model's engine on the CPU, runs `batch` prompts into decode, captures one
decode pass's plan and output, and times the four codec calls.
"""

from __future__ import annotations

import argparse
import logging
import time

import numpy as np

from deltaserve import SamplingParams
from deltaserve.cluster.config import EngineConfig
from deltaserve.cluster.entrypoints.demo_model import ensure_demo_model
from deltaserve.cluster.entrypoints.startup import build_engine
from deltaserve.workers.wire import decode_output, decode_plan, encode_output, encode_plan


def _per_call_us(fn, n: int = 200) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def measure(batch: int, context: int) -> dict:
    config = EngineConfig.from_kwargs(
        model=str(ensure_demo_model()), device="cpu", max_num_seqs=batch, async_scheduling=False,
        num_kv_blocks=batch * (context // 16 + 4), max_model_len=context + 64,
    )  # fmt: skip
    core = build_engine(config)
    rng = np.random.default_rng(batch)
    vocab = core.model_config.vocab_size
    for i in range(batch):
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        core.add_request(f"r{i}", rng.integers(10, vocab - 10, context).tolist(), params)
    while core.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running):
        core.step()
    captured = {}
    execute = core.executor.execute

    def spy(plan):
        captured["plan"], captured["output"] = plan, execute(plan)
        return captured["output"]

    core.executor.execute = spy
    core.step()
    core.shutdown()
    plan, output = captured["plan"], captured["output"]
    plan_blob, output_blob = encode_plan(plan), encode_output(output)
    return {
        "batch": batch,
        "plan_bytes": len(plan_blob),
        "encode_plan_us": _per_call_us(lambda: encode_plan(plan)),
        "decode_plan_us": _per_call_us(lambda: decode_plan(plan_blob)),
        "output_bytes": len(output_blob),
        "encode_output_us": _per_call_us(lambda: encode_output(output)),
        "decode_output_us": _per_call_us(lambda: decode_output(output_blob)),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,64,256")
    parser.add_argument("--context", type=int, default=300)
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        r = measure(batch, args.context)
        total = r["encode_plan_us"] + r["decode_plan_us"] + r["encode_output_us"] + r["decode_output_us"]
        print(
            f"batch {batch:>4}: plan {r['plan_bytes']:>6} B  encode {r['encode_plan_us']:5.0f} us  decode"
            f" {r['decode_plan_us']:5.0f} us | output {r['output_bytes']:>5} B  encode {r['encode_output_us']:4.0f} us"
            f"  decode {r['decode_output_us']:4.0f} us | total {total:5.0f} us",
            flush=True,
        )


if __name__ == "__main__":
    main()
