"""Speculative decoding benchmark (MTP head): what a verify pass costs against a plain decode step, and
the time per output token with drafts that agree with the target at a set rate.

    deltaserve bench spec --preset qwen3_5_35b_a3b --ks 1,2,3,4,5,6,7,8 --batches 1,16,64 \\
        --k 3 --token-batches 1,16 --agreements 0.5,0.7,0.8,0.9,1.0 --json spec.json

Passes (one engine, its pools idle; pages and slots are scratch): at each batch, a plain decode step
replayed from a CUDA graph and run eagerly; for each k, the verify pass (the target over k + 1 tokens
a row, its logits, the greedy acceptance, write-on-accept) and the head's work after it (catch-up
over the k + 1 positions and k - 1 draft steps). Per output token: the engine with k = --k serves
greedy requests whose drafts come from a ReferenceDrafter (test-only: the reference run's tokens,
each kept with the set agreement; the head still runs), timed over steady decoding steps. The
reference is the same engine's output with the head's own drafts (greedy output does not depend on
the drafts), so the measured agreement sits at the set one unless the numerics of the two runs
part ways; both are reported. With random bf16 weights they do part ways (near-tied logits flip with
each verify's rows and offsets, and every later draft misses), so by default the per-token runs of a
random-weight model use it rewritten to be decisive (spec_drafts.make_decisive, bench-only, labelled
in the report): each token's successor wins by a margin no rounding reaches, at the same cost.

Floors (bytes over the copy bandwidth measured in the run, as bench offline prints them): a
speculative step must read the non-expert weights once (lm_head included), the distinct experts
its b (k + 1) verify tokens route to, the KV and GDN state of its rows, and for each of the k head
passes (the catch-up, then k - 1 draft steps) the head's layer, fc and the lm_head again, with the
experts its tokens route to. Routing is counted as random (uniform top-k, independent tokens:
E (1 - (1 - top_k / E)^T) distinct experts for T tokens), what a random-weight model does; a real
checkpoint's consecutive tokens share experts more, so its floor is lower.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.layers.config import ModelConfig
from deltaserve.layers.kernels import argmax as argmax_kernels
from deltaserve.workers.context import build_forward_context, logits_rows
from deltaserve.workers.rejection import accept_drafts
from deltaserve.workers.spec_decode import SpecDecoder

from .offline import decode_floor_bytes, weight_bytes
from .presets import PRESETS, preset_config
from .spec_drafts import ReferenceDrafter, make_decisive


class Timer:
    """Median milliseconds of a callable: CUDA events on a GPU, the wall clock on the CPU."""

    def __init__(self, device: torch.device, repeats: int, warmup: int = 3):
        self.cuda, self.repeats, self.warmup = device.type == "cuda", repeats, warmup

    def __call__(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.repeats):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def expected_distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts T tokens touch in one MoE layer when each picks top_k of E uniformly."""
    if num_experts <= 0 or tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def spec_floor_bytes(model_config: ModelConfig, batch: int, k: int, context: int, dtype_bytes: int = 2) -> dict:
    """Bytes one speculative step must read at batch b with k drafts a row (random routing; see the
    module docstring): "verify" (the target over b (k + 1) tokens: weights, distinct experts, KV,
    GDN state read and written back on accept), "drafts" (k head passes: the head's layer, fc and
    lm_head each, their experts and the head's KV), "total"; k = 0 is a plain decode step."""
    c = model_config
    moe_layers = sum(t == "moe" for t in c.mlp_types)
    tokens = batch * (k + 1)
    distinct = moe_layers * expected_distinct_experts(c.num_experts, c.num_experts_per_tok, tokens)
    verify = decode_floor_bytes(c, batch, context + k + 1, distinct, dtype_bytes)
    out = {"verify": verify["total"], "verify_experts": verify["experts"], "drafts": 0, "drafts_experts": 0}
    if k:
        head = c.mtp_layer_config()
        head_dense, expert = weight_bytes(head, dtype_bytes)  # one attention layer, its FFN, the lm_head
        head_dense += 2 * c.hidden_size * c.hidden_size * dtype_bytes  # fc
        head_tokens = [tokens] + [batch] * (k - 1)  # the catch-up, then one token a row per draft step
        experts = 0.0
        if head.mlp_types[0] == "moe":
            experts = sum(expected_distinct_experts(c.num_experts, c.num_experts_per_tok, t) for t in head_tokens)
        kv = k * batch * (context + k) * 2 * c.num_kv_heads * c.head_dim * dtype_bytes
        out["drafts_experts"] = experts * expert
        out["drafts"] = k * head_dense + experts * expert + kv
    out["total"] = out["verify"] + out["drafts"]
    return out


def tokens_per_step(agreement: float, k: int) -> float:
    """Expected tokens a verify row emits at per-draft agreement a: 1 + a + ... + a^k."""
    return float(sum(agreement**i for i in range(k + 1)))


def scratch_plan(batch: int, context: int, new: int, block_size: int, vocab: int, k: int = 0):
    """A plan of `batch` rows with `context` cached tokens and `new` tokens each (verify rows when k),
    on pages 0.. and slots 0.. (scratch: the engine is idle)."""
    from deltaserve.workers.plan import PassPlan

    pages = -(-(context + new + max(k - 1, 0)) // block_size)
    tables = np.arange(batch * pages, dtype=np.int32).reshape(batch, pages)
    pos = np.tile(np.arange(context, context + new), batch)
    rows = np.repeat(np.arange(batch), new)
    slots = tables[rows, pos // block_size].astype(np.int64) * block_size + pos % block_size
    rng = np.random.default_rng(batch * 100 + new)
    return PassPlan(
        pass_id=0,
        req_ids=[f"s{i}" for i in range(batch)],
        num_decode_rows=batch,
        input_ids=rng.integers(10, vocab - 10, batch * new).astype(np.int32),
        positions=pos.astype(np.int32),
        slot_mapping=slots,
        query_start_loc=np.arange(0, batch * new + 1, new, dtype=np.int32),
        seq_lens=np.full(batch, context + new, np.int32),
        block_tables=tables,
        state_slots=np.arange(batch, dtype=np.int32),
        has_initial_state=np.ones(batch, bool),
        sample_rows=np.ones(batch, bool),
        prompt_logprob_rows=np.zeros(batch, bool),
        next_prompt_token=np.full(batch, -1, np.int32),
        num_spec_tokens=k,
        draft_rows=np.full(batch, k > 0),
    )


def _floor(model_config: ModelConfig, batch: int, k: int, context: int, bandwidth: float | None) -> dict:
    """spec_floor_bytes with its time at the measured bandwidth (None on the CPU: bytes only)."""
    floor = spec_floor_bytes(model_config, batch, k, context)
    out = {"bytes": floor}
    if bandwidth:
        out["ms"] = floor["total"] / bandwidth * 1e3
        out["verify_ms"] = floor["verify"] / bandwidth * 1e3
        out["drafts_ms"] = floor["drafts"] / bandwidth * 1e3
    return out


def bench_passes(
    llm: LLM, batches: list[int], ks: list[int], context: int, repeats: int, bandwidth: float | None = None
) -> list[dict]:
    runner = llm.engine.executor.runner
    model, pool, device = runner.model, runner.pool, runner.device
    bs, vocab = pool.sizes.block_size, model.config.vocab_size
    timer = Timer(device, repeats)
    pdl = runner.kernels.pdl
    graphs = None
    if device.type == "cuda":
        from deltaserve.workers.cuda_graph import DecodeGraphs

        graphs = DecodeGraphs(
            model,
            pool.layer_states,
            device=device,
            max_pages=-(-(context + 2 * max(ks) + 1) // bs),
            scratch_slot=pool.sizes.num_slots - 1,
            scratch_page=pool.sizes.num_blocks - 1,
            batch_sizes=tuple(batches),
            kernels=runner.kernels,
        )
    # the engine's own verify buffers: its graphs were captured on them, so they stay alive and come
    # back after each k's own buffers (a graph replay over freed buffers would write into other memory)
    engine_buffers = _verify_buffers(pool)
    rows = []
    for b in batches:
        plan = scratch_plan(b, context, 1, bs, vocab)
        indices, _ = logits_rows(plan)

        def eager(plan=plan, indices=indices):
            ctx = build_forward_context(plan, model.config, model.layout, device, indices, kernels=runner.kernels)
            with torch.inference_mode():
                argmax_kernels.row_argmax(logits=model.compute_logits(model(ctx, pool.layer_states)), pdl=pdl)

        row = {
            "batch": b,
            "decode_eager_ms": timer(eager),
            "decode_floor": _floor(model.config, b, 0, context, bandwidth),
        }
        if graphs is not None:
            row["decode_graph_ms"] = timer(
                lambda plan=plan: argmax_kernels.row_argmax(logits=graphs.run(plan), pdl=pdl)
            )
        decode_ms = row.get("decode_graph_ms", row["decode_eager_ms"])
        for k in ks:
            row[f"k{k}"] = _verify_costs(llm, b, k, context, timer, decode_ms, engine_buffers)
            row[f"k{k}"]["floor"] = _floor(model.config, b, k, context, bandwidth)
        rows.append(row)
        print(_pass_line(row, ks), flush=True)
    return rows


def _verify_buffers(pool) -> tuple[list[dict], object]:
    return [dict(vars(s)) for s in pool.layer_states], pool.verify_stack


def _restore(pool, buffers: tuple[list[dict], object]) -> None:
    states, pool.verify_stack = buffers
    for state, saved in zip(pool.layer_states, states, strict=True):
        vars(state).update(saved)


def _verify_costs(
    llm: LLM, b: int, k: int, context: int, timer: Timer, decode_ms: float, engine_buffers: tuple[list[dict], object]
) -> dict:
    runner = llm.engine.executor.runner
    model, pool, device = runner.model, runner.pool, runner.device
    if k == runner.spec.k:
        _restore(pool, engine_buffers)
    else:
        pool.enable_verify(model, rows=b, length=k + 1)
    spec = SpecDecoder(model, pool, k)
    plan = scratch_plan(b, context, k + 1, pool.sizes.block_size, model.config.vocab_size, k)
    indices, _ = logits_rows(plan)
    held = {}

    def verify():
        ctx = build_forward_context(plan, model.config, model.layout, device, indices, kernels=runner.kernels)
        with torch.inference_mode():
            hidden = model(ctx, pool.layer_states)
            logits = model.compute_logits(hidden)
            sampled = argmax_kernels.row_argmax(logits=logits, pdl=runner.kernels.pdl).view(b, k + 1)
            accepted = accept_drafts(sampled, ctx.input_ids.view(b, k + 1)[:, 1:])
            model.write_on_accept(pool.layer_states, ctx.decode.state_slots, accepted, stack=pool.verify_stack)
        held.update(ctx=ctx, hidden=hidden, sampled=sampled, accepted=accepted)

    verify_ms = timer(verify)

    def draft():
        spec.after_sampling(plan, held["ctx"], held["hidden"], held["sampled"], held["accepted"], None, [-1] * b)

    draft_ms = timer(draft)
    out = {"verify_ms": verify_ms, "verify_over_decode": verify_ms / decode_ms, "draft_ms": draft_ms}
    graphs = runner.verify_graphs
    own = graphs is not None and graphs.k == k
    if device.type == "cuda" and not own:
        # another k than the engine's: its whole step captured here, on this k's verify buffers
        from deltaserve.workers.spec_graphs import VerifyGraphs

        graphs = VerifyGraphs(
            model,
            spec,
            max_pages=plan.block_tables.shape[1],
            scratch_slot=pool.sizes.num_slots - 1,
            scratch_page=pool.sizes.num_blocks - 1,
            batch_sizes=(b,),
            device=device,
            kernels=runner.kernels,
        )
    if graphs is not None and graphs.k == k and graphs.can_run(plan):
        # the whole step (verify, acceptance, write-on-accept, the head's catch-up and drafts) from a graph
        out["step_graph_ms"] = timer(lambda: graphs.run(plan))
        out["step_graph_over_decode"] = out["step_graph_ms"] / decode_ms
    if device.type == "cuda" and not own:
        del graphs
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    _restore(pool, engine_buffers)
    return out


def profile_step(llm: LLM, b: int, context: int, steps: int = 3) -> str:
    """Each GPU op's in-place cost in the engine's whole speculative step replayed from its graph
    (offline.marginal_table), batch b: where a verify step's time goes."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from .offline import marginal_table

    runner = llm.engine.executor.runner
    graphs = runner.verify_graphs
    k = runner.spec.k
    plan = scratch_plan(b, context, k + 1, runner.pool.sizes.block_size, runner.model.config.vocab_size, k)
    if graphs is None or not graphs.can_run(plan):
        return f"no verify graph for batch {b}"
    for _ in range(3):
        graphs.run(plan)
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            graphs.run(plan)
        torch.cuda.synchronize()
    return f"--- batch {b}, k = {k}: the speculative step from its graph ---\n" + marginal_table(prof, steps)


GOAL_MS_PER_TOKEN = 1.0  # issue 21: batch 1 at 0.8 agreement
GOAL_AGREEMENT = 0.8


def goal_floor(model_config: ModelConfig, k: int, context: int, bandwidth: float | None) -> dict:
    """The batch-1 goal against the floor: the step time GOAL_MS_PER_TOKEN allows at GOAL_AGREEMENT
    with k drafts, and the floor's step and per-token times there (bytes only without a bandwidth)."""
    per_step = tokens_per_step(GOAL_AGREEMENT, k)
    floor = _floor(model_config, 1, k, context, bandwidth)
    goal = {"k": k, "agreement": GOAL_AGREEMENT, "tokens_per_step": per_step}
    goal["goal_step_ms"] = GOAL_MS_PER_TOKEN * per_step
    goal["floor"] = floor
    line = (
        f"goal: batch 1, k={k}, agreement {GOAL_AGREEMENT}: {GOAL_MS_PER_TOKEN} ms per output token = a step of "
        f"{goal['goal_step_ms']:.3f} ms ({per_step:.3f} tokens a step)"
    )
    b = floor["bytes"]
    experts = (b["verify_experts"] + b["drafts_experts"]) / 1e9
    line += f"; the step reads {b['total'] / 1e9:.2f} GB (experts {experts:.2f} GB, the head's passes"
    line += f" {b['drafts'] / 1e9:.2f} GB)"
    if "ms" in floor:
        goal["floor_ms_per_token"] = floor["ms"] / per_step
        line += f": floor {floor['ms']:.3f} ms a step, {goal['floor_ms_per_token']:.3f} ms per output token"
    goal["line"] = line
    return goal


def _pass_line(row: dict, ks: list[int]) -> str:
    head = f"batch {row['batch']:>3}: decode {row.get('decode_graph_ms', float('nan')):.3f} ms (graph), "
    head += f"{row['decode_eager_ms']:.3f} ms (eager)"
    if "ms" in row["decode_floor"]:
        head += f"; floor {row['decode_floor']['ms']:.3f} ms"
    parts = []
    for k in ks:
        r = row[f"k{k}"]
        line = f"k={k} verify {r['verify_ms']:.3f} ms (x{r['verify_over_decode']:.2f}) + head {r['draft_ms']:.3f} ms"
        if "step_graph_ms" in r:
            line += f"; whole step from its graph {r['step_graph_ms']:.3f} ms (x{r['step_graph_over_decode']:.2f})"
        floor = r["floor"]
        if "ms" in floor:
            measured = r.get("step_graph_ms", r["verify_ms"] + r["draft_ms"])
            line += (
                f"; step floor {floor['ms']:.3f} ms (verify {floor['verify_ms']:.3f} + drafts "
                f"{floor['drafts_ms']:.3f}; the step at x{measured / floor['ms']:.2f} floor)"
            )
        parts.append(line)
    return head + "\n  " + "\n  ".join(parts)


def bench_tokens(
    llm: LLM, batch: int, agreements: list[float], context: int, steps: int, bandwidth: float | None = None
) -> list[dict]:
    """ms per output token (per sequence) at `batch` for each agreement, and the reference run's;
    with the bandwidth, the floor per output token at the tokens a row each step measured."""
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    k = engine.scheduler.k
    rng = np.random.default_rng(batch)
    prompts = [rng.integers(10, vocab - 10, context).tolist() for _ in range(batch)]
    warm = 4
    # rows prefilled first decode while the others still prefill: a step of margin for each row
    max_tokens = (steps + warm + 2 + batch) * (k + 1) + 8
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine.scheduler.drafter = None
    reference_out = llm.generate(prompts, params, use_tqdm=False)
    reference = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, reference_out, strict=True)}
    rows = []
    for agreement in [None, *agreements]:
        engine.scheduler.drafter = None if agreement is None else ReferenceDrafter(reference, agreement, vocab)
        rows.append(_timed_decode(llm, prompts, params, steps, warm, agreement))
        r = rows[-1]
        label = "head's drafts" if agreement is None else f"agreement {agreement:.1f}"
        floor = _floor(engine.model_config, batch, k, context, bandwidth)
        if "ms" in floor:
            r["floor_ms_per_token"] = floor["ms"] / r["tokens_per_row_step"]
        print(
            f"batch {batch:>3}, k={k}, {label}: {r['ms_per_token']:.3f} ms per output token "
            f"({r['step_ms']:.3f} ms a step, {r['tokens_per_row_step']:.2f} tokens a row; "
            f"measured acceptance {r['acceptance']:.3f})"
            + (f"; floor {r['floor_ms_per_token']:.3f} ms per token" if "floor_ms_per_token" in r else ""),
            flush=True,
        )
    engine.scheduler.drafter = None
    return rows


def _timed_decode(llm: LLM, prompts, params, steps: int, warm: int, agreement) -> dict:
    engine = llm.engine
    tag = f"{agreement}-{len(prompts)}"
    for i, p in enumerate(prompts):
        engine.add_request(f"tok{tag}-{i}", p, params)
    scheduler = engine.scheduler
    while scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running):
        engine.step()
    for _ in range(warm):
        engine.step()
    running = list(engine.scheduler.running)
    before = sum(len(r.output_token_ids) for r in running)
    stats = engine.scheduler.spec_stats
    drafted, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed_ms = (time.perf_counter() - t0) * 1e3
    emitted = sum(len(r.output_token_ids) for r in running) - before
    if any(r.is_finished for r in running):
        raise RuntimeError("a request finished while timed: raise max_tokens")
    drafted, accepted = stats.num_draft_tokens - drafted, stats.num_accepted_tokens - accepted
    for r in running:
        engine.abort(r.req_id)
    while engine.has_unfinished():
        engine.step()
    per_row = emitted / len(running) / steps
    return {
        "agreement": agreement,
        "step_ms": elapsed_ms / steps,
        "tokens_per_row_step": per_row,
        "ms_per_token": elapsed_ms / steps / per_row,
        "acceptance": accepted / drafted if drafted else 0.0,
    }


def run(args: argparse.Namespace) -> dict:
    model_config = preset_config(args.preset) if args.preset else ModelConfig.from_pretrained(args.model)
    batches = [int(b) for b in args.batches.split(",") if b]
    token_batches = [int(b) for b in args.token_batches.split(",") if b]
    ks = [int(k) for k in args.ks.split(",") if k]
    agreements = [float(a) for a in args.agreements.split(",") if a]
    if model_config.num_mtp_layers < 1:  # a preset of random weights: give it the released head
        import dataclasses

        model_config = dataclasses.replace(model_config, num_mtp_layers=1)
    llm = LLM(
        args.model,
        model_config=model_config,
        load_format=args.load_format,
        device=args.device,
        max_num_seqs=max([*batches, *token_batches]),
        max_model_len=args.context + (args.steps + 8 + max(token_batches, default=0)) * (args.k + 1) + 64,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=False,
        speculative_config={"method": "mtp", "num_speculative_tokens": args.k},
    )
    device = llm.engine.executor.runner.device
    report = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "model": args.preset or args.model,
        "context": args.context,
        "draft": "ReferenceDrafter (test-only: the reference run's tokens at a set agreement)",
    }
    bandwidth = None
    if device.type == "cuda":
        from .offline import copy_bandwidth

        bandwidth = copy_bandwidth("cuda")
        report["copy_bw_TBps"] = bandwidth / 1e12
    report["goal"] = goal = goal_floor(model_config, args.k, args.context, bandwidth)
    print(goal["line"], flush=True)
    for b in args.profile_step:
        print(profile_step(llm, b, args.context), flush=True)
    report["passes"] = bench_passes(llm, batches, ks, args.context, args.repeats, bandwidth)
    decisive = args.load_format == "random" if args.decisive is None else args.decisive
    if decisive and token_batches:
        make_decisive(llm.engine.executor.runner.model)
        report["model_for_tokens"] = (
            "decisive random weights (bench-only, spec_drafts.make_decisive: output projections zeroed, each "
            "token's successor decisive), so that drafts from a reference run agree with the verify at the set rate"
        )
        print(f"per-token runs: {report['model_for_tokens']}", flush=True)
    report["tokens"] = {
        str(b): bench_tokens(llm, b, agreements, args.context, args.steps, bandwidth) for b in token_batches
    }
    llm.shutdown()
    return report


def add_parser(sub) -> None:
    p = sub.add_parser("spec", help="speculative decoding: verify passes vs decode, ms per token at set agreements")
    p.add_argument("--model", default=None, help="checkpoint dir (or use --preset with random weights)")
    p.add_argument("--preset", default=None, choices=sorted(PRESETS))
    p.add_argument("--load-format", default="random")
    p.add_argument("--device", default="auto")
    p.add_argument("--ks", default="1,2,3,4,5,6,7,8", help="drafts per verify row for the pass timings")
    p.add_argument("--batches", default="1,16,64", help="batch sizes of the pass timings")
    p.add_argument("--k", type=int, default=3, help="drafts per verify row of the per-token timings")
    p.add_argument("--token-batches", default="1,16")
    p.add_argument("--agreements", default="0.5,0.7,0.8,0.9,1.0")
    p.add_argument("--context", type=int, default=512, help="prompt tokens per sequence")
    p.add_argument(
        "--decisive",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="per-token runs on the model rewritten so each token's successor is decisive (bench-only; "
        "random bf16 weights' near-ties part the verify from the reference run); default: with random weights",
    )
    p.add_argument("--steps", type=int, default=24, help="timed engine steps per agreement")
    p.add_argument("--repeats", type=int, default=20, help="timed repeats per pass")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument(
        "--profile-step",
        type=lambda v: [int(b) for b in v.split(",") if b],
        default=[],
        help="print each GPU op's in-place cost in the graphed speculative step at these batch sizes",
    )
    p.add_argument("--json", default=None)
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    report = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0
