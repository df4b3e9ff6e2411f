"""LoRA decode benchmark: decode step time with 1 and 8 distinct adapters against no adapter, at
several batch sizes, in one process (one engine, its CUDA graphs with and without adapters).

    deltaserve bench lora --preset qwen3_5_35b_a3b --batch-sizes 1,16,64 --adapters 1,8 --rank 16 --json lora.json

The adapters are random, rank `--rank`, on every projection and every routed expert, written into
the device slots in place (an adapter of this shape is ~2 GB a file: nothing is written to disk);
sequence i of a batch runs on adapter i mod N. Goal (issue 25): 8 adapters at batch 64 within 1.3x
of no adapter.
"""

from __future__ import annotations

import argparse

import torch

from deltaserve import LLM
from deltaserve.cluster.config import EngineConfig, add_engine_args, engine_kwargs
from deltaserve.cluster.core.lora import Adapter, LoRARequest
from deltaserve.layers.config import ModelConfig
from deltaserve.layers.lora import randomize_slot
from deltaserve.workers.plan import LoraLoad

from .offline import bench_decode, run_on_cuda
from .presets import PRESETS, preset_config


def install_random_adapters(llm: LLM, count: int, rank: int) -> list[LoRARequest]:
    """`count` random adapters already in device slots 0..count-1 (the registry and the worker's slots
    told so directly: there is no file to load). In-process engine only."""
    engine = llm.engine
    runner = engine.executor.runner
    registry = engine.loras
    requests = []
    for slot in range(count):
        request = LoRARequest(f"random-{slot}", slot + 1, f"<random rank {rank}>")
        adapter = Adapter(request, key=-(slot + 1), rank=rank, has_experts=True)
        randomize_slot(runner.model, slot, rank, seed=slot)
        runner.lora.held[slot] = LoraLoad(slot, adapter.key, request.lora_name, request.lora_path)
        runner.lora.has_experts[slot] = True
        registry.by_id[request.lora_int_id] = registry.by_name[request.lora_name] = adapter
        registry.slots[slot].adapter = adapter
        requests.append(request)
    return requests


def run(args: argparse.Namespace) -> dict:
    counts = [int(n) for n in args.adapters.split(",") if n]
    batches = [int(b) for b in args.batch_sizes.split(",") if b]
    settings = EngineConfig.from_kwargs(**engine_kwargs(args))
    model_config = preset_config(args.preset) if args.preset else ModelConfig.from_pretrained(settings.load.model)
    llm = LLM(
        model_config=model_config,
        **settings.replace(
            enable_lora=True,
            max_loras=max(counts),
            max_lora_rank=args.rank,
            max_num_seqs=max(batches),
            max_num_batched_tokens=max(args.context * 4, 2048),
            max_model_len=args.context + 2 * args.steps + 256,
            cuda_graph_max_batch=max(batches),
        ).to_kwargs(),
    )
    if not hasattr(llm.engine.executor, "runner"):
        raise SystemExit("bench lora runs the in-process engine (TP = 1)")
    adapters = install_random_adapters(llm, max(counts), args.rank)
    rows = []
    for b in batches:
        base = bench_decode(
            llm, b, args.context, args.steps, None, model_config.vocab_size, args.profile_steps, tag="base"
        )["step_s"]
        row = {"batch": b, "no_lora_ms": base * 1e3}
        for n in counts:
            step = bench_decode(
                llm, b, args.context, args.steps, None, model_config.vocab_size, args.profile_steps, tag=f"lora{n}",
                loras=adapters[:n],
            )["step_s"]  # fmt: skip
            row[f"lora{n}_ms"], row[f"lora{n}_x"] = step * 1e3, step / base
        rows.append(row)
        print(
            f"batch {b:>4}: no LoRA {base * 1e3:7.2f} ms"
            + "".join(f" | {n} adapter(s) {row[f'lora{n}_ms']:7.2f} ms ({row[f'lora{n}_x']:.2f}x)" for n in counts),
            flush=True,
        )
    llm.shutdown()
    return {
        "device": torch.cuda.get_device_name(),
        "model": args.preset or settings.load.model,
        "rank": args.rank,
        "context": args.context,
        "cuda_graphs": not settings.runner.enforce_eager,
        "decode": rows,
    }


def add_parser(sub) -> None:
    p = sub.add_parser("lora", help="decode step time with 1 and N random LoRA adapters against none")
    p.add_argument("--preset", default=None, choices=sorted(PRESETS), help="a model shape with random weights")
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--adapters", default="1,8", help="distinct adapters per batch to time (comma list)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--context", type=int, default=512, help="prompt tokens per decoding sequence")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument(
        "--profile-steps", type=int, default=0,
        help="after the timing, this many decode steps under torch.profiler: kernel table and in-place costs",
    )  # fmt: skip
    add_engine_args(
        p,
        exclude=(
            "max_num_seqs", "max_num_batched_tokens", "max_model_len", "enable_lora", "max_loras", "max_lora_rank",
            "cuda_graph_max_batch", "max_waiting_requests",
        ),
        defaults={"load_format": "random"},
    )  # fmt: skip
    p.add_argument("--json", default=None)
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    return run_on_cuda("lora", run, args)
