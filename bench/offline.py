"""Offline benchmark: `LLM` decode step latency and throughput at several batch sizes, prefill
throughput at several prompt lengths, and in the same run the peer (transformers' generate on the
same random-weight model) and each batch's memory floor.

    deltaserve bench offline --preset qwen3_5_35b_a3b --batch-sizes 1,16,64,256 --json out.json

The floor of a decode step is the bytes it must read, over the copy bandwidth measured in this run:
the non-expert weights, the distinct experts that the step's routing selected (counted with hooks
on the MoE blocks during a timed step), the KV pages the step attends over, and the GDN state
(read and written).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import zlib

import numpy as np
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.cluster.config import EngineConfig, add_engine_args, engine_kwargs
from deltaserve.cluster.core.sampling_params import StructuredOutputsParams
from deltaserve.layers.config import ModelConfig
from deltaserve.layers.kernels.options import KernelOptions
from deltaserve.layers.moe import SparseMoeBlock

from .presets import PRESETS, preset_config


def copy_bandwidth(device: str) -> float:
    """Bytes/s (read + write) of a device-to-device copy of 1 GiB, median of 20."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n / statistics.median(times[5:])


class ExpertCounter:
    """Counts the distinct experts each MoE block routes to while enabled."""

    def __init__(self, model):
        self.blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
        self.enabled = False
        self.distinct: list[int] = []
        for block in self.blocks:
            block.register_forward_hook(self._hook)

    def _hook(self, block, inputs, output) -> None:
        if not self.enabled:
            return
        x = inputs[0]
        logits = torch.nn.functional.linear(x, block.router)
        ids = torch.topk(logits.float(), block.top_k, dim=-1).indices
        self.distinct.append(int(torch.unique(ids).numel()))


def weight_bytes(model_config: ModelConfig, dtype_bytes: int, fp8: bool = False) -> tuple[int, int]:
    """(bytes of all non-expert weights, bytes of one routed expert). fp8: the projections a block-FP8
    model quantizes take one byte a weight and 4 bytes a 128 x 128 block; the lm_head, router,
    shared-expert gate, GDN b / a rows, conv and norms keep dtype_bytes."""
    c = model_config
    h = c.hidden_size
    q = 1 + 4 / (128 * 128) if fp8 else dtype_bytes  # bytes per quantized weight, scales included
    expert = 3 * h * c.moe_intermediate_size * q
    kept = c.vocab_size * h  # lm_head (the embedding is read one row per token)
    quantized = 0
    if c.hyper is not None:  # Qwen4-Exp: two stream mixers a layer and the final one (never quantized)
        width = c.hyper.count * h
        kept += (2 * c.num_layers + 1) * (
            2 * width * c.hyper.lowrank + width
        ) + 2 * c.num_layers * c.hyper.count * width
        if c.ple is not None:  # its projections and norms (the table is read a few rows per token)
            kept += len(c.ple.layer_ids) * ((width + h) * c.ple.embed_dim + (3 + c.ple.conv_kernel_size) * width)
    for i in range(c.num_layers):
        kept += 2 * h  # norms
        if c.layer_types[i] == "full_attention":
            d = c.head_dim
            quantized += h * (2 * c.num_attention_heads * d + 2 * c.num_kv_heads * d) + c.num_attention_heads * d * h
            if c.qsa is not None:  # the indexer's projection stays unquantized
                kept += h * (c.qsa.num_heads + 1) * c.qsa.head_dim
        else:
            quantized += (2 * c.gdn_key_dim + 2 * c.gdn_value_dim) * h + c.gdn_value_dim * h
            kept += 2 * c.linear_num_value_heads * h + c.gdn_conv_dim * c.conv_kernel_size
        if c.mlp_types[i] == "moe":
            kept += c.num_experts * h + h
            quantized += 3 * h * c.shared_expert_intermediate_size
        else:
            quantized += 3 * h * c.intermediate_size
    return int(kept * dtype_bytes + quantized * q), int(expert)


def decode_floor_bytes(
    model_config: ModelConfig, batch: int, context: int, distinct_experts: float, dtype_bytes: int = 2,
    fp8: bool = False, kv_dtype_bytes: int | None = None,
) -> dict:  # fmt: skip
    """Bytes one decode step must read; kv_dtype_bytes: the KV cache's element size (the model's if None)."""
    c = model_config
    kv_elem = dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes
    dense, expert = weight_bytes(model_config, dtype_bytes, fp8)
    experts = distinct_experts * expert
    kv = batch * context * len(c.attention_layer_ids) * 2 * c.num_kv_heads * c.head_dim * kv_elem
    if c.qsa is not None:  # QSA: the selected tokens' KV and every block key the indexer scores
        attended = min(context, c.qsa.budget + c.qsa.compress_ratio - 1) * 2 * c.num_kv_heads * c.head_dim
        scored = (context // c.qsa.compress_ratio) * c.qsa.head_dim
        kv = batch * len(c.attention_layer_ids) * (attended + scored) * kv_elem
    gdn = (
        batch
        * len(c.gdn_layer_ids)
        * (
            2 * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
            + 2 * c.gdn_conv_dim * (c.conv_kernel_size - 1) * dtype_bytes
        )
    )
    return {"weights": dense, "experts": experts, "kv": kv, "gdn_state": gdn, "total": dense + experts + kv + gdn}


def bench_decode(
    llm: LLM,
    batch: int,
    context: int,
    steps: int,
    counter: ExpertCounter | None,
    vocab: int,
    profile_steps: int = 0,
    tag: str = "",
    loras: list | None = None,
    structured_outputs: StructuredOutputsParams | None = None,
) -> dict:
    """Decode timing of `batch` sequences of `context` prompt tokens; `tag` keeps request ids
    distinct when a process times the same batch again (variants); `loras`: the LoRARequest (or None)
    of sequence i is loras[i % len(loras)]; `structured_outputs`: every row under this constraint (one
    whose output outlasts the timed steps)."""
    engine = llm.engine
    rng = np.random.default_rng(batch)
    # the first prompts decode beside the later ones' prefill chunks, for as many passes as the
    # scheduler takes to fit them (the decode rows take part of each pass's budget): as many tokens
    # as fit, so that no request finishes mid-timing (the batch would shrink); aborted at the end
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True, structured_outputs=structured_outputs)
    for i in range(batch):
        lora = loras[i % len(loras)] if loras else None
        engine.add_request(
            f"d{tag}{batch}-{i}", rng.integers(10, vocab - 10, context).tolist(), params, lora_request=lora
        )
    # run until every request is decoding (prefill done, first token out)
    while (
        any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or engine.scheduler.waiting
    ):
        engine.step()
    for _ in range(2):
        engine.step()  # warm: the decode shape at this batch
    counts = []
    if counter is not None:  # one eager step with hooks on (graph replays run no hooks)
        runner = engine.executor.runner
        graphs, runner.graphs = runner.graphs, None
        counter.enabled, counter.distinct = True, []
        engine.step()
        counter.enabled, runner.graphs, counts = False, graphs, list(counter.distinct)
    executor = engine.executor
    if hasattr(executor, "pass_times"):
        executor.pass_times.clear()
    # (time of `steps` consecutive steps) / steps, one sync at each end: with async scheduling a step
    # launches the next pass while the previous one still runs, so syncing around each step would
    # take away the very overlap being measured
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - t0) / steps
    _check_whole(engine, batch)
    sync_step_s = None
    # control overhead is taken over synchronous passes (under overlap it also counts time a reply
    # waits while the driver plans the next pass); the exposed wait over the timed steps as run
    timings = {"device": _device_times(engine, steps)}
    if hasattr(executor, "exposed_wait_s"):
        timings["exposed_wait_s"] = executor.exposed_wait_s(last=steps)
        timings["overlapped_stages_s"] = executor.control_stages_s(last=steps)
    if engine.async_scheduling:  # the same steps without overlap, for the comparison
        engine.set_async_scheduling(False)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        sync_step_s = (time.perf_counter() - t0) / steps
        _check_whole(engine, batch)
        timings["sync_device"] = _device_times(engine, steps)
        engine.set_async_scheduling(True)
    if hasattr(executor, "control_overhead_s"):
        timings["control_overhead_s"] = executor.control_overhead_s(last=steps)
        timings["control_stages_s"] = executor.control_stages_s(last=steps)
    profile = None
    if profile_steps:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(profile_steps):
                engine.step()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / profile_steps
        events = prof.key_averages()
        gpu_us = sum(e.self_device_time_total for e in events) / profile_steps
        launches = sum(e.count for e in events if e.self_device_time_total > 0) / profile_steps
        profile = events.table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=72)
        print(
            f"--- profile of {profile_steps} decode steps at batch {batch}: GPU busy {gpu_us / 1e3:.2f} ms/step, "
            f"wall {wall * 1e3:.2f} ms/step (profiled), ~{launches:.0f} GPU ops/step ---\n{profile}",
            flush=True,
        )
        print(marginal_table(prof, profile_steps), flush=True)
    for i in range(batch):
        engine.abort(f"d{tag}{batch}-{i}")
    while engine.has_unfinished():  # a pass still in flight
        engine.step()
    result = {"step_s": step_s, "sync_step_s": sync_step_s, "distinct_experts_per_layer": counts, **timings}
    return result


def marginal_table(prof, steps: int, rows: int = 40) -> str:
    """Each GPU op's in-place cost per step (in_place_cost over the profiler's trace) as a table."""
    import json
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as trace_file:
            trace = json.load(trace_file)
    ops = [
        (e["ts"], e["ts"] + e["dur"], e["name"])
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    ]
    cost = in_place_cost(ops)
    total = sum(us for us, _ in cost.values())
    lines = [
        f"--- in-place cost per step (end minus previous end): {total / steps / 1e3:.3f} ms"
        f" over {len(ops) / steps:.0f} ops ---"
    ]
    for name, (us, count) in sorted(cost.items(), key=lambda kv: -kv[1][0])[:rows]:
        lines.append(f"{us / steps:9.1f} us  {count / steps:6.1f}x  {us / count:7.2f} us each  {name[:90]}")
    return "\n".join(lines)


def in_place_cost(ops: list[tuple[float, float, str]]) -> dict[str, tuple[float, int]]:
    """name -> (summed in-place cost, count) of device ops given as (start, end, name), in order of
    their ends: an op's end minus the previous op's end, or, after an idle gap, minus the earliest
    start among the ops still running. Under programmatic dependent launch a kernel's own duration
    includes its wait for the one before; this attribution does not, and its total is the
    timeline's busy time (the union of the ops' intervals)."""
    ordered = sorted(ops, key=lambda op: (op[1], op[0]))
    open_from = [0.0] * len(ordered)  # the earliest start among this op and those ending later
    earliest = float("inf")
    for i in range(len(ordered) - 1, -1, -1):
        earliest = min(earliest, ordered[i][0])
        open_from[i] = earliest
    cost: dict[str, tuple[float, int]] = {}
    prev_end = float("-inf")
    for (_, end, name), since in zip(ordered, open_from, strict=True):
        us, count = cost.get(name, (0.0, 0))
        cost[name] = (us + max(0.0, end - max(prev_end, since)), count + 1)
        prev_end = max(prev_end, end)
    return cost


def _check_whole(engine, batch: int) -> None:
    """Every request of the batch still decoding: a timing over fewer sequences is not this batch's."""
    running = len(engine.scheduler.running)
    if running != batch or engine.scheduler.waiting:
        raise RuntimeError(
            f"decode batch {batch}: {running} running after the timed steps (one reached max_model_len, or the KV "
            "cache holds too few tokens for the batch's context and steps)"
        )


def bench_prefill(
    llm: LLM, length: int, vocab: int, profile: bool = False, tag: str = "", busy: list | None = None
) -> float:
    """The best of two timed prefills of a `length`-token prompt (one discarded before them), each
    a fresh random prompt (no prefix-cache hit); `profile`: then one under torch.profiler, its
    kernel table and each kernel's in-place cost printed (GPU busy against wall: idle GPU time is
    host time). busy: gets the GPU busy seconds of the best one's passes (CUDA events, with
    time_passes), where there are any, and then the host seconds from add_request to the first pass's
    launch (the time the GPU waits on the scheduler)."""
    engine = llm.engine
    # prompts of their own per variant: the same tokens again would hit the prefix cache
    rng = np.random.default_rng([length, zlib.crc32(tag.encode())])
    device_times = getattr(engine, "pass_device_times", None)

    launches: list[float] = []
    executor = engine.executor
    execute_async = executor.execute_async

    def timed_launch(plan):
        launches.append(time.perf_counter())
        return execute_async(plan)

    def one(rep: int) -> tuple[float, float | None, float]:
        launches.clear()
        prompt = rng.integers(10, vocab - 10, length).tolist()  # made before the clock starts: the user's list
        t0 = time.perf_counter()
        engine.add_request(
            f"p{tag}{length}-{rep}", prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        )
        before = len(device_times) if device_times is not None else 0
        while engine.has_unfinished():
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        passes = list(device_times)[before:] if device_times is not None else []
        return wall, (sum(t[0] for t in passes) if passes else None), launches[0] - t0

    executor.execute_async = timed_launch  # an instance attribute over the method, removed below
    try:
        runs = [one(rep) for rep in range(3)]
    finally:
        del executor.execute_async
    best = min(runs[1:], key=lambda r: r[0])
    if busy is not None and best[1] is not None:
        busy += [best[1], best[2]]
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            executor.execute_async = timed_launch
            try:
                wall = one(3)[0]
            finally:
                del executor.execute_async
        events = prof.key_averages()
        gpu_us = sum(e.self_device_time_total for e in events)
        launches = sum(e.count for e in events if e.self_device_time_total > 0)
        table = events.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=72)
        print(
            f"--- profile of a {length}-token prefill{f' [{tag}]' if tag else ''}: GPU busy {gpu_us / 1e3:.2f} ms, "
            f"wall {wall * 1e3:.2f} ms, {launches} GPU ops ---"
        )
        print(table, flush=True)
        print(marginal_table(prof, 1, rows=64), flush=True)
    return best[0]


def bench_peer(model_config: ModelConfig, batches: list[int], context: int, steps: int) -> dict:
    """transformers on the same shapes with random bf16 weights: per-step decode time."""
    from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

    raw = dict(model_config.raw)
    hf_config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16).eval()
    out = {}
    for b in batches:
        ids = torch.randint(10, 1000, (b, context), device="cuda")
        with torch.inference_mode():
            cache = DynamicCache(config=hf_config)
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]
            times = []
            for _ in range(steps):
                nxt = logits.argmax(-1, keepdim=True)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                logits = model(input_ids=nxt, past_key_values=cache, use_cache=True).logits[:, -1]
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
        out[b] = statistics.median(times[1:])
        del cache
        torch.cuda.empty_cache()
    del model
    torch.cuda.empty_cache()
    return out


def run(args: argparse.Namespace) -> dict:
    settings = EngineConfig.from_kwargs(**engine_kwargs(args))  # the engine flags, checked
    model = settings.load.model
    model_config = preset_config(args.preset) if args.preset else ModelConfig.from_pretrained(model)
    batches = [int(b) for b in args.batch_sizes.split(",") if b]
    prefills = [int(n) for n in args.prefill_lens.split(",") if n]
    bandwidth = copy_bandwidth("cuda")
    report = {
        "device": torch.cuda.get_device_name(),
        "copy_bw_TBps": bandwidth / 1e12,
        "model": args.preset or model,
        "context": args.context,
        "cuda_graphs": not settings.runner.enforce_eager,
        "tp": settings.parallel.tensor_parallel_size,
        "ep": settings.parallel.enable_expert_parallel,
        "quantization": settings.load.quantization or (model_config.quantization and "fp8"),
    }
    peer = {}
    if args.peer:
        peer = bench_peer(model_config, [b for b in batches if b <= args.peer_max_batch], args.context, 6)
        report["peer_step_s"] = peer
    llm = LLM(
        model_config=model_config,
        **settings.replace(
            max_num_seqs=max(batches, default=1),
            max_num_batched_tokens=max([*prefills, args.context * 4, 2048]),
            max_model_len=max([*prefills, args.context + 2 * args.steps + 64, 4096]) + 64,  # decode rows' prompts too
            time_passes=True,  # GPU busy / idle per pass from CUDA events (two events a pass)
        ).to_kwargs(),
    )
    runner = getattr(llm.engine.executor, "runner", None)
    counter = ExpertCounter(runner.model) if runner is not None else None
    variants = parse_variants(args.variants)
    if any(settings for _, settings in variants) and runner is None:
        raise SystemExit("--variants needs the in-process engine (TP = 1): the runner takes each variant's options")
    base = runner.kernels if runner is not None else None
    rows, pre = [], []
    for label, settings in variants:
        if settings:  # the decode graphs are captured again under the variant's options
            runner.set_kernel_options(base.with_settings(settings))
        for b in batches:
            row = _decode_row(args, llm, model_config, bandwidth, counter, peer, b, tag=label)
            if label:
                row["variant"] = label
            rows.append(row)
            print(_fmt_decode(row), flush=True)
        pre += time_prefills(llm, prefills, model_config.vocab_size, args, label)
        if settings:  # the next variant starts from the process's options
            runner.set_kernel_options(base)
    report["decode"] = rows
    report["prefill"] = pre
    llm.shutdown()
    return report


def time_prefills(llm: LLM, lengths: list[int], vocab: int, args: argparse.Namespace, label: str = "") -> list[dict]:
    """One row per prompt length (bench_prefill): whether the pass replayed a prefill CUDA graph, and
    with --prefill-eager-too the same length again with the graphs set aside (eager), in this process."""
    runner = getattr(llm.engine.executor, "runner", None)
    graphs = getattr(runner, "prefill_graphs", None)
    tagged = f"[{label}] " if label else ""
    rows = []
    for n in lengths:
        replays = graphs.replays if graphs is not None else 0
        busy: list[float] = []
        seconds = bench_prefill(llm, n, vocab, profile=n in args.profile_prefills, tag=label, busy=busy)
        graphed = graphs is not None and graphs.replays > replays
        row = {"tokens": n, "seconds": seconds, "tok_s": n / seconds, "graphed": graphed}
        how = " (CUDA graph)" if graphed else ""
        if busy:  # GPU busy well under the wall time: the host sets the pace
            row["gpu_busy_s"], row["host_before_s"] = busy
            how += f"  GPU busy {busy[0] * 1e3:.1f} ms, host before the pass {busy[1] * 1e3:.2f} ms"
        if label:
            row["variant"] = label
        print(f"{tagged}prefill {n:>6} tokens: {seconds * 1e3:8.1f} ms  {n / seconds:10.0f} tok/s{how}", flush=True)
        if graphed and args.prefill_eager_too:
            runner.prefill_graphs = None
            try:
                eager = bench_prefill(llm, n, vocab, tag=f"{label}eager")
            finally:
                runner.prefill_graphs = graphs
            row.update(eager_seconds=eager, eager_tok_s=n / eager)
            print(f"{tagged}prefill {n:>6} tokens: {eager * 1e3:8.1f} ms  {n / eager:10.0f} tok/s (eager)", flush=True)
        rows.append(row)
    return rows


def parse_variants(spec: str | None) -> list[tuple[str, dict[str, str]]]:
    """`--variants "base:;nopdl:pdl=0;x:route_in_up_max_tokens=8,row_gemv=0"` -> [(label, KernelOptions
    settings by field name)]: each variant times every batch size with the process's options and
    those settings (the decode graphs captured again for them). None: one unnamed variant, the
    process's options. A setting that names no option, or a bad value, is an error naming it."""
    if not spec:
        return [("", {})]
    variants = []
    for item in spec.split(";"):
        label, _, text = item.strip().partition(":")
        settings = {}
        for pair in filter(None, (p.strip() for p in text.split(","))):
            name, eq, value = pair.partition("=")
            if not eq or not name:
                raise ValueError(f"--variants: {pair[:40]!r} in variant {label!r} is not NAME=VALUE")
            settings[name] = value
        if not label:
            raise ValueError(f"--variants: {item[:40]!r} has no label (label:NAME=VALUE,...)")
        KernelOptions().with_settings(settings)  # names and values checked before anything runs
        variants.append((label, settings))
    if len({label for label, _ in variants}) != len(variants):
        raise ValueError("--variants: labels must differ")
    return variants


def _decode_row(
    args, llm, model_config: ModelConfig, bandwidth: float, counter, peer: dict, b: int, tag: str = ""
) -> dict:
    """One batch size's decode timing as a report row (floor, x floor, control stages, peer)."""
    profile_steps = 3 if b in args.profile_batches else 0
    result = bench_decode(llm, b, args.context, args.steps, counter, model_config.vocab_size, profile_steps, tag=tag)
    per_layer = result["distinct_experts_per_layer"]
    moe_layers = sum(t == "moe" for t in model_config.mlp_types)
    if per_layer:  # counted by the hooks in this run
        distinct = sum(per_layer)
    else:  # worker processes (TP/EP): no hooks here, so the bound every step stays under
        distinct = moe_layers * min(model_config.num_experts, b * model_config.num_experts_per_tok)
    fp8 = model_config.quantization is not None or llm.config.load.quantization == "fp8"
    floor = decode_floor_bytes(
        model_config, b, args.context + 4, distinct, fp8=fp8, kv_dtype_bytes=1 if llm.config.cache.kv_fp8 else None
    )
    floor_s = floor["total"] / bandwidth / max(1, llm.config.parallel.tensor_parallel_size)
    row = {
        "batch": b,
        "step_ms": result["step_s"] * 1e3,
        "tok_s": b / result["step_s"],
        "floor_ms": floor_s * 1e3,
        "x_floor": result["step_s"] / floor_s,
        "expert_fraction": distinct / (model_config.num_experts * moe_layers),
        "experts_counted": bool(per_layer),
        "floor_bytes": floor,
    }
    if "control_overhead_s" in result:
        row["control_overhead_ms"] = result["control_overhead_s"] * 1e3
    for key in ("device", "sync_device"):
        if result.get(key):
            row[f"gpu_{key}_ms"] = result[key]
    for key in ("control_stages_s", "overlapped_stages_s"):
        if result.get(key) and (key == "control_stages_s" or result["sync_step_s"] is not None):
            row[key[: -len("_s")] + "_ms"] = {k: v * 1e3 for k, v in result[key].items()}
    if "exposed_wait_s" in result:
        row["exposed_wait_ms"] = result["exposed_wait_s"] * 1e3
    if result["sync_step_s"] is not None:
        row["sync_step_ms"] = result["sync_step_s"] * 1e3
    if b in peer:
        row["peer_step_ms"] = peer[b] * 1e3
        row["speedup_vs_peer"] = peer[b] / result["step_s"]
    return row


def _device_times(engine, steps: int) -> dict[str, float] | None:
    """Median GPU busy time per pass and GPU idle time before it over the last `steps` passes (CUDA
    events, LLM(time_passes=True)), in ms; None without them."""
    import statistics

    times = list(engine.pass_device_times)[-steps:]
    if not times:
        return None
    return {
        "busy_ms": statistics.median(t[0] for t in times) * 1e3,
        "idle_ms": statistics.median(t[1] for t in times) * 1e3,
        # the step is a mean: these show whether a few slow passes or gaps make up its difference
        "mean_busy_ms": statistics.fmean(t[0] for t in times) * 1e3,
        "mean_idle_ms": statistics.fmean(t[1] for t in times) * 1e3,
        "max_idle_ms": max(t[1] for t in times) * 1e3,
    }


def _fmt_decode(r: dict) -> str:
    s = (
        (f"[{r['variant']}] " if "variant" in r else "")
        + f"decode batch {r['batch']:>4}: {r['step_ms']:8.2f} ms/step {r['tok_s']:9.1f} tok/s"
        f" | floor {r['floor_ms']:7.2f} ms ({r['x_floor']:.2f}x floor,"
        f" experts {'touched' if r['experts_counted'] else 'bound'} {100 * r['expert_fraction']:.0f}%)"
    )
    if "sync_step_ms" in r:
        s += f" | without overlap {r['sync_step_ms']:.2f} ms"
    if "control_overhead_ms" in r:
        s += f" | control overhead {r['control_overhead_ms']:.3f} ms"
    if "exposed_wait_ms" in r:
        s += f" | exposed wait {r['exposed_wait_ms']:.3f} ms"
    if "gpu_device_ms" in r:
        d = r["gpu_device_ms"]
        s += f" | GPU per pass: busy {d['busy_ms']:.3f} ms, idle before {d['idle_ms']:.3f} ms"
        if "mean_busy_ms" in d:
            s += f" (means {d['mean_busy_ms']:.3f} / {d['mean_idle_ms']:.3f}, idle max {d['max_idle_ms']:.3f})"
        if "gpu_sync_device_ms" in r:
            s += f" (without overlap: idle before {r['gpu_sync_device_ms']['idle_ms']:.3f} ms)"
    if "peer_step_ms" in r:
        s += f" | transformers {r['peer_step_ms']:8.2f} ms ({r['speedup_vs_peer']:.1f}x faster)"
    if "control_stages_ms" in r:
        s += "\n    control stages (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in r["control_stages_ms"].items())
    if "overlapped_stages_ms" in r:
        s += "\n    overlapped passes (ms): " + ", ".join(
            f"{k} {v:.3f}" for k, v in r["overlapped_stages_ms"].items() if k.startswith("device")
        )
    return s


def add_parser(sub) -> None:
    p = sub.add_parser("offline", help="LLM.generate decode/prefill benchmark with peer and memory floor")
    p.add_argument("--preset", default=None, choices=sorted(PRESETS), help="a model shape with random weights")
    p.add_argument("--batch-sizes", default="1,16,64,256")
    p.add_argument("--context", type=int, default=512, help="prompt tokens per decoding sequence")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--prefill-lens", default="2048,8192,32768")
    p.add_argument("--peer", action="store_true", help="also time transformers on the same shapes")
    p.add_argument("--peer-max-batch", type=int, default=64)
    # the engine's own flags; batch limits and pass timing follow from the benchmark's shapes
    add_engine_args(
        p,
        exclude=("max_num_seqs", "max_num_batched_tokens", "max_model_len", "time_passes", "max_waiting_requests"),
        defaults={"load_format": "random"},
    )
    p.add_argument(
        "--profile-batches",
        type=lambda v: [int(b) for b in v.split(",") if b],
        default=[],
        help="print a torch.profiler kernel table of 3 decode steps at these batch sizes",
    )
    p.add_argument(
        "--profile-prefills",
        type=lambda v: [int(n) for n in v.split(",") if n],
        default=[],
        help="print a torch.profiler kernel table of one prefill at these prompt lengths",
    )
    p.add_argument(
        "--prefill-eager-too",
        action="store_true",
        help="time each prefill that replayed a CUDA graph (--prefill-graph-max-tokens) again eagerly, in one process",
    )
    p.add_argument(
        "--variants",
        default=None,
        help='A/B in one process: "label:NAME=VALUE,...;label2:..." times every batch size under each '
        "variant's kernel options (KernelOptions fields, e.g. pdl=0, row_tiles=2048x4096:16x8), the decode "
        "graphs captured again for each; TP = 1",
    )
    p.add_argument("--json", default=None)
    p.set_defaults(func=_main)


def run_on_cuda(name: str, run, args: argparse.Namespace) -> int:
    """A benchmark's command: `run(args)` on a CUDA device, its report written to --json."""
    if not torch.cuda.is_available():
        print(f"bench {name} needs a CUDA device")
        return 2
    report = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0


def _main(args: argparse.Namespace) -> int:
    return run_on_cuda("offline", run, args)
