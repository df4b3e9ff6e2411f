"""Prefix-caching benchmark: time to first token for a long shared prefix with a hit against a miss,
and decode step time with caching on against off, in one process on one engine.

    deltaserve bench prefix --preset qwen3_5_35b_a3b --shared 16384 --new 256 --decode-batches 1,16,64

A miss is a prompt whose prefix nobody sent before (with caching on it also leaves snapshots along the
way, whose cost the miss includes); a hit resends that prefix with new tokens after it, so the engine
restores the GDN snapshot at the prefix's end, shares its KV pages and runs only the new tokens. The
same miss with caching off is the baseline a cache must not slow down.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.layers.config import ModelConfig

from .offline import bench_decode, marginal_table, run_on_cuda
from .presets import PRESETS, preset_config


def time_to_first_token(llm: LLM, prompt: list[int], req_id: str) -> tuple[float, int]:
    """(seconds from add to the first token, tokens skipped) of one request run alone."""
    engine = llm.engine
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.add_request(req_id, prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    cached = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                cached = out.num_cached_tokens
    torch.cuda.synchronize()
    return time.perf_counter() - t0, cached


def bench_ttft(llm: LLM, shared: int, new: int, repeats: int, vocab: int) -> dict:
    rng = np.random.default_rng(shared)
    rows = {"miss_off": [], "miss": [], "hit": []}
    cached = []
    engine = llm.engine
    for rep in range(repeats + 1):  # the first round warms up the shapes
        prefix = rng.integers(10, vocab - 10, shared).tolist()
        suffixes = [rng.integers(10, vocab - 10, new).tolist() for _ in range(3)]
        engine.set_prefix_caching(False)
        off, _ = time_to_first_token(llm, prefix + suffixes[0], f"off{rep}")
        engine.set_prefix_caching(True)
        miss, _ = time_to_first_token(llm, prefix + suffixes[1], f"miss{rep}")
        hit, skipped = time_to_first_token(llm, prefix + suffixes[2], f"hit{rep}")
        if rep:
            rows["miss_off"].append(off)
            rows["miss"].append(miss)
            rows["hit"].append(hit)
            cached.append(skipped)
    med = {k: statistics.median(v) * 1e3 for k, v in rows.items()}
    return {
        "shared": shared,
        "new": new,
        "ttft_ms": med,
        "hit_over_miss": med["hit"] / med["miss_off"],
        "cached_tokens": cached,
        "cache": llm.engine.prefix_cache_stats(),
    }


def profile_hit(llm: LLM, shared: int, new: int, vocab: int) -> dict:
    """One more miss, then its hit under torch.profiler: the kernel table and each kernel's in-place
    cost printed; GPU busy against wall (the difference is host time: hashing, scheduling)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    rng = np.random.default_rng(shared + 1)
    prefix = rng.integers(10, vocab - 10, shared).tolist()
    time_to_first_token(llm, prefix + rng.integers(10, vocab - 10, new).tolist(), "profmiss")
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall, skipped = time_to_first_token(llm, prefix + rng.integers(10, vocab - 10, new).tolist(), "profhit")
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events)
    launches = sum(e.count for e in events if e.self_device_time_total > 0)
    print(
        f"--- profile of a hit ({skipped} tokens skipped): GPU busy {gpu_us / 1e3:.2f} ms, wall {wall * 1e3:.2f} ms "
        f"(profiled), {launches} GPU ops ---",
        flush=True,
    )
    print(events.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=72), flush=True)
    print(marginal_table(prof, 1), flush=True)
    return {"gpu_busy_ms": gpu_us / 1e3, "wall_ms": wall * 1e3, "gpu_ops": launches, "skipped": skipped}


class _Timed:
    """Wraps methods of some objects (instance attributes, removed on exit) to sum their wall time
    per label; `sync_after` labels also time how long the GPU runs on after them."""

    def __init__(self, targets: list[tuple[str, object, str]], sync_after: tuple[str, ...] = ()):
        self.targets, self.sync_after = targets, sync_after
        self.ms: dict[str, float] = {}
        for label, _, _ in targets:
            self.ms[label] = 0.0
        for label in sync_after:
            self.ms[f"{label} drain"] = 0.0

    def __enter__(self) -> _Timed:
        for label, obj, name in self.targets:
            setattr(obj, name, self._wrap(label, getattr(obj, name)))
        return self

    def _wrap(self, label: str, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            t1 = time.perf_counter()
            self.ms[label] += (t1 - t0) * 1e3
            if label in self.sync_after:  # how long the GPU still runs after the host has queued it all
                torch.cuda.synchronize()
                self.ms[f"{label} drain"] += (time.perf_counter() - t1) * 1e3
            return out

        return timed

    def __exit__(self, *exc) -> None:
        for _, obj, name in self.targets:
            delattr(obj, name)


def host_timeline(llm: LLM, shared: int, new: int, vocab: int) -> dict:
    """One more miss, then its hit with the host's stages timed: the request's checks, scheduling
    (lookup included), the forward's launches (host) and how long the GPU runs after the last of them
    (drain: near 0 means the GPU waited on the launches), sampling and outputs. In-process runner only."""
    runner = getattr(llm.engine.executor, "runner", None)
    if runner is None:
        return {}
    engine = llm.engine
    rng = np.random.default_rng(shared + 2)
    prefix = rng.integers(10, vocab - 10, shared).tolist()
    time_to_first_token(llm, prefix + rng.integers(10, vocab - 10, new).tolist(), "tlmiss")
    targets = [
        ("add_request", engine, "make_request"),
        ("schedule", engine.scheduler, "schedule"),
        ("lookup", engine.scheduler.prefix, "lookup"),
        ("execute_async", runner, "execute_async"),
        ("forward launches", runner, "_forward"),
        ("apply", engine, "_apply"),
    ]
    # the forward's launches by part (host time: nothing in them waits for the GPU)
    for layer in getattr(runner.model, "layers", []):
        mixer, mlp = getattr(layer, "mixer", None), getattr(layer, "mlp", None)
        if mixer is not None:
            targets.append(("attention mix" if getattr(layer, "is_attention", False) else "gdn mix", mixer, "mix"))
        if mlp is not None:
            targets.append(("mlp", mlp, "forward"))
    with _Timed(targets, sync_after=("forward launches",)) as timed:
        wall, skipped = time_to_first_token(llm, prefix + rng.integers(10, vocab - 10, new).tolist(), "tlhit")
    ms = {k: round(v, 3) for k, v in timed.ms.items()}
    ms["wall"] = round(wall * 1e3, 3)
    print(
        f"--- host timeline of a hit ({skipped} tokens skipped), ms: "
        + ", ".join(f"{k} {v:.2f}" for k, v in ms.items())
        + " (execute_async includes the forward's launches and drain) ---",
        flush=True,
    )
    return ms


def host_profile(llm: LLM, shared: int, new: int, vocab: int, rows: int = 40) -> dict:
    """One more miss, then its hit under cProfile: the host functions by own time and by cumulative time
    (where the eager forward's ~90 us a launch goes: Triton's launcher, torch ops, our wrappers)."""
    import cProfile
    import io
    import pstats

    rng = np.random.default_rng(shared + 3)
    prefix = rng.integers(10, vocab - 10, shared).tolist()
    time_to_first_token(llm, prefix + rng.integers(10, vocab - 10, new).tolist(), "cpmiss")
    prof = cProfile.Profile()
    prof.enable()
    wall, skipped = time_to_first_token(llm, prefix + rng.integers(10, vocab - 10, new).tolist(), "cphit")
    prof.disable()
    for order in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(order).print_stats(rows)
        print(f"--- cProfile of a hit ({skipped} skipped, wall {wall * 1e3:.1f} ms under the profiler), by {order} ---")
        print(buf.getvalue(), flush=True)
    return {"wall_ms_profiled": wall * 1e3}


def bench_decode_on_off(llm: LLM, batches: list[int], context: int, steps: int, vocab: int) -> list[dict]:
    rows = []
    engine = llm.engine
    for b in batches:
        times = {}
        for label, on in (("off", False), ("on", True), ("off2", False), ("on2", True)):
            engine.set_prefix_caching(on)
            times[label] = bench_decode(llm, b, context, steps, None, vocab, tag=f"pc{label}")["step_s"] * 1e3
            for req in list(engine.scheduler.running):
                engine.abort(req.req_id)
            while engine.has_unfinished():
                engine.step()
        on_ms, off_ms = min(times["on"], times["on2"]), min(times["off"], times["off2"])
        rows.append({"batch": b, "on_ms": on_ms, "off_ms": off_ms, "on_over_off": on_ms / off_ms, "all_ms": times})
    engine.set_prefix_caching(True)
    return rows


def run(args: argparse.Namespace) -> dict:
    model_config = preset_config(args.preset) if args.preset else ModelConfig.from_pretrained(args.model)
    batches = [int(b) for b in args.decode_batches.split(",") if b]
    llm = LLM(
        args.model,
        model_config=model_config,
        load_format=args.load_format,
        max_num_seqs=max([*batches, 4]),
        max_model_len=args.shared + args.new + 64,
        gpu_memory_utilization=args.gpu_memory_utilization,
        prefix_snapshot_interval=args.interval,
    )
    report = {
        "device": torch.cuda.get_device_name(),
        "model": args.preset or args.model,
        "interval": args.interval,
        "snapshot_slots": llm.engine.prefix_cache_stats().get("snapshot_slots", 0),
    }
    ttft = bench_ttft(llm, args.shared, args.new, args.repeats, model_config.vocab_size)
    report["ttft"] = ttft
    t = ttft["ttft_ms"]
    print(
        f"TTFT, {args.shared}-token shared prefix + {args.new} new tokens: miss (caching off) {t['miss_off']:.1f} ms, "
        f"miss (caching on) {t['miss']:.1f} ms, hit {t['hit']:.1f} ms -> hit / miss = {ttft['hit_over_miss']:.3f} "
        f"(skipped {ttft['cached_tokens']} tokens)",
        flush=True,
    )
    if args.profile_hit:
        report["host_timeline"] = host_timeline(llm, args.shared, args.new, model_config.vocab_size)
        report["profile_hit"] = profile_hit(llm, args.shared, args.new, model_config.vocab_size)
        report["host_profile"] = host_profile(llm, args.shared, args.new, model_config.vocab_size)
    if batches:
        report["decode"] = bench_decode_on_off(llm, batches, args.context, args.steps, model_config.vocab_size)
        for r in report["decode"]:
            print(
                f"decode batch {r['batch']:>4}: caching on {r['on_ms']:.3f} ms/step, off {r['off_ms']:.3f} ms/step "
                f"({100 * (r['on_over_off'] - 1):+.2f}%)",
                flush=True,
            )
    return report


def add_parser(sub) -> None:
    p = sub.add_parser("prefix", help="prefix caching: TTFT hit vs miss, decode step with caching on vs off")
    p.add_argument("--model", default=None, help="checkpoint dir (or use --preset with random weights)")
    p.add_argument("--preset", default=None, choices=sorted(PRESETS))
    p.add_argument("--load-format", default="random")
    p.add_argument("--shared", type=int, default=16384, help="tokens of the shared prefix")
    p.add_argument("--new", type=int, default=256, help="tokens after it")
    p.add_argument("--interval", type=int, default=1024, help="prefix_snapshot_interval")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--decode-batches", default="1,16,64")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument(
        "--profile-hit",
        action="store_true",
        help="print a hit's host timeline (checks, scheduling, the forward's launches and the GPU's drain after"
        " them), a torch.profiler kernel table of one hit and a cProfile of another",
    )
    p.add_argument("--json", default=None)
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    return run_on_cuda("prefix", run, args)
