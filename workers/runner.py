"""ModelRunner: one rank's model shard, state pools and sampler. `execute(plan)` runs one pass and,
on TP rank 0, returns the sampled tokens. The single-process engine calls it directly; the Ray
worker actor wraps it.

`execute_async(plan)` launches the pass and returns a `PassOutput` without waiting for the device:
the sampled ids stay in a device tensor (the next plan's `input_from_prev` rows read their input
from it), their copy to pinned host memory is non-blocking behind one CUDA event, and
`PassOutput.result()` waits for that event. Outputs are resolved in pass order; before a pass
samples, every pass but the one just before it is resolved (its ids feed the penalties). Every TP
rank samples (same logits, seeds and counters: the same ids), so that a plan's `input_from_prev`
rows find their ids on every rank; only TP rank 0 computes logprobs and returns the RunnerOutput.

Structured output: every rank holds the grammar matchers of its requests (`workers/grammar.py`). A
constrained row's mask needs its latest token on the host: when that token comes from the pass
still unresolved, the runner resolves it after launching the new pass's forward (the device runs
the forward while the host advances the matchers and fills the masks), never before.
"""

from __future__ import annotations

import gc
import logging
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from deltaserve.layers.base import MoeLoraRoute
from deltaserve.layers.config import ModelConfig
from deltaserve.layers.kernels.options import KernelOptions
from deltaserve.layers.loader import load_model
from deltaserve.layers.parallel import ParallelLayout
from deltaserve.workers import warmup
from deltaserve.workers.compile_watch import LateCompileLog, during_startup
from deltaserve.workers.config import WorkerConfig
from deltaserve.workers.context import HostCopy, build_forward_context, logits_rows, upload
from deltaserve.workers.grammar import GrammarCompiler
from deltaserve.workers.lora import AdapterSlots
from deltaserve.workers.plan import PassPlan, PoolSizes, RunnerOutput
from deltaserve.workers.sampler import LogprobParts, SampledBatch, Sampler
from deltaserve.workers.spec_decode import SpecDecoder
from deltaserve.workers.state_pool import StatePool, size_pools
from deltaserve.workers.wire import check_plan_ranges, check_prev_ids, check_spec_engine

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@dataclass(frozen=True)
class PrevPass:
    """The last launched pass's sampled ids on the device (every rank's): the next plan's
    `input_from_prev` rows take their input ids from them."""

    pass_id: int
    tokens: torch.Tensor


class ModelRunner:
    @during_startup  # loading (FP8 quantization at load), the profiling pass and its warm-up compile
    def __init__(self, config: WorkerConfig, model_config: ModelConfig, layout: ParallelLayout | None = None):
        self.config = config
        self.model_config = model_config
        self.layout = layout or ParallelLayout()
        load = config.load
        self.device = torch.device(load.device)
        self.dtype = DTYPES[load.dtype_in_use]
        # the KV pages' dtype: the model's, or float8 e4m3 (cache.kv_cache_dtype)
        self.kv_dtype = torch.float8_e4m3fn if config.cache.kv_fp8 else self.dtype
        self.model = load_model(
            load.model,
            config=model_config,
            layout=self.layout,
            dtype=self.dtype,
            device=self.device,
            load_format=load.load_format,
            seed=load.seed,
            quantization=load.quantization,
            mtp=config.runner.num_speculative_tokens > 0,
        )
        # LoRA adapter slots (allocated with the weights, before the pools are sized)
        self.lora = AdapterSlots(self.model, config.lora) if config.lora.enable_lora else None
        self.pool: StatePool | None = None
        self.spec: SpecDecoder | None = None
        self.verify_graphs = None
        self.graphs = None
        self.prefill_graphs = None
        self.late_compiles: LateCompileLog | None = None  # set once start-up is over (allocate)
        self.kernels = config.runner.kernels
        tokenizer_dir = load.model if load.model and (Path(load.model) / "tokenizer.json").is_file() else None
        grammars = GrammarCompiler(tokenizer_dir, model_config.vocab_size, model_config.eos_token_ids)
        self.sampler = Sampler(model_config.vocab_size, seed=load.seed, pdl=self.kernels.pdl, grammars=grammars)
        self._unresolved: deque[PassOutput] = deque()  # launched passes whose output is not read yet
        self._last_pass_end = None  # with runner.time_passes: the last launched pass's end event
        self._prev: PrevPass | None = None  # the last launched pass's sampled ids, on the device
        self.sizes = self._size_pools()  # what this rank could hold; the executor picks the final sizes

    @property
    def is_driver_rank(self) -> bool:
        return self.layout.tp_rank == 0

    def _size_pools(self) -> PoolSizes:
        cache = self.config.cache
        if cache.num_kv_blocks is not None:
            budget = 0
        elif self.device.type == "cuda":
            budget = self._gpu_budget()
        else:
            budget = cache.cpu_kv_cache_bytes
        return size_pools(
            self.model,
            budget_bytes=budget,
            block_size=cache.block_size,
            max_num_seqs=self.config.max_num_seqs,
            dtype=self.dtype,
            num_blocks_override=cache.num_kv_blocks,
            num_snapshots=cache.num_prefix_snapshots if cache.enable_prefix_caching else 0,
            kv_dtype=self.kv_dtype,
        )

    def _gpu_budget(self) -> int:
        """Memory left for pools: utilisation x total, minus weights and a profiled activation peak."""
        torch.cuda.synchronize(self.device)
        gc.collect()  # an engine dropped earlier in this process still holds cached blocks until then
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        activation = self._profile_activation_bytes()
        used = total - free
        budget = int(total * self.config.cache.gpu_memory_utilization) - used - activation
        log.info(
            "GPU memory: %.1f GiB total, %.1f GiB in use after weights, %.1f GiB activation peak, %.1f GiB for pools",
            total / 2**30,
            used / 2**30,
            activation / 2**30,
            budget / 2**30,
        )
        return budget

    def _profile_activation_bytes(self) -> int:
        """Peak extra memory of a pass of max_num_batched_tokens prompt tokens (one sequence)."""
        tokens, block_size = self.config.max_num_batched_tokens, self.config.cache.block_size
        pages = -(-tokens // block_size)
        # slots for the warm-up batches' rows too (a few GiB at most, freed below)
        slots = warmup.warmup_slots()
        # two snapshot slots: the warm-up also runs the prefix-cache capture kernels
        snapshots = 2 if self.config.cache.enable_prefix_caching else 0
        sizes = PoolSizes(num_blocks=pages + 1, block_size=block_size, num_slots=slots, num_snapshots=snapshots)
        pool = StatePool(self.model, sizes, dtype=self.dtype, device=self.device, kv_dtype=self.kv_dtype)
        plan = warmup.profile_plan(tokens, block_size)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        self._forward(plan, pool)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        self.compile_warmup(pool)
        torch.cuda.synchronize(self.device)
        del pool
        torch.cuda.empty_cache()
        graphed = min(self.config.runner.prefill_graph_max_tokens, tokens)
        if self._prefill_graphs_wanted():  # the prefill graphs' memory pool: about a pass of their largest bucket
            peak += int(peak * min(1.0, (graphed + 1) / tokens))
        k = self.config.runner.num_speculative_tokens
        if k:  # a verify pass's logits: k + 1 rows a sequence, widened to float32 and drawn from (~4 copies)
            peak = max(peak, self.config.max_num_seqs * (k + 1) * self.model_config.vocab_size * 4 * 4)
        return int(peak * 1.1)

    def compile_warmup(self, pool: StatePool) -> int:
        """Run the start-up warm-up passes that fit on `pool`'s scratch pages and slots, outputs dropped
        (workers/warmup.py); returns how many ran."""
        return warmup.compile_warmup(self, pool)

    @during_startup
    def allocate(self, sizes: PoolSizes) -> None:
        """Allocate the pools (the same sizes on every rank); from here on a Triton compile is logged
        (`compile_watch`): start-up compiled what it could."""
        self.sizes = sizes
        self.pool = StatePool(self.model, sizes, dtype=self.dtype, device=self.device, kv_dtype=self.kv_dtype)
        k = self.config.runner.num_speculative_tokens
        if k:
            self.pool.enable_verify(self.model, rows=self.config.max_num_seqs, length=k + 1)
            self.spec = SpecDecoder(self.model, self.pool, k)
        if self.device.type == "cuda" and self.config.cache.num_kv_blocks is not None:
            # given sizes skip the profiling pass, which runs the warm-up: run it on the empty pool
            self.compile_warmup(self.pool)
        self.graphs = self._capture_graphs()
        self.verify_graphs = self._capture_verify_graphs()
        self.prefill_graphs = self._capture_prefill_graphs()
        if self.device.type == "cuda":  # after the graph captures, which compile the decode kernels
            self.late_compiles = LateCompileLog()
            self.late_compiles.install()

    def _capture_graphs(self):
        """The decode CUDA graphs over the pools (None on CPU or with graphs off)."""
        if self.device.type != "cuda" or self.config.runner.enforce_eager or self.spec is not None:
            return None  # speculative passes need the hidden states the graphs do not return
        from deltaserve.workers.cuda_graph import DEFAULT_BATCH_SIZES, DecodeGraphs

        sizes = self.sizes
        max_len = self.model_config.max_position_embeddings
        return DecodeGraphs(
            self.model,
            self.pool.layer_states,
            device=self.device,
            max_pages=min(sizes.num_blocks, -(-max_len // sizes.block_size)),
            scratch_slot=sizes.num_slots - 1,
            scratch_page=sizes.num_blocks - 1,
            batch_sizes=tuple(b for b in DEFAULT_BATCH_SIZES if b <= self.config.runner.cuda_graph_max_batch),
            kernels=self.kernels,
            lora=self.lora,
        )

    def _prefill_graphs_wanted(self) -> bool:
        from deltaserve.workers.prefill_graphs import prefill_graphs_fit

        runner = self.config.runner
        return (
            self.device.type == "cuda"
            and not runner.enforce_eager
            and runner.num_speculative_tokens == 0  # speculative passes need the hidden states
            and runner.prefill_graph_max_tokens > 0
            and prefill_graphs_fit(self.model)
        )

    def _capture_prefill_graphs(self, capture: bool = True):
        """The prefill CUDA graphs over the pools (None on CPU, with graphs off or for a model whose
        layers keep more per-slot or per-page state than GDN and KV). capture=False: the same static,
        padded forward run eagerly (tests)."""
        if capture and not self._prefill_graphs_wanted():
            return None
        from deltaserve.workers.prefill_graphs import PrefillGraphs, token_buckets

        sizes = self.sizes
        max_len = self.model_config.max_position_embeddings
        return PrefillGraphs(
            self.model,
            self.pool.layer_states,
            max_pages=min(sizes.num_blocks, -(-max_len // sizes.block_size)),
            block_size=sizes.block_size,
            scratch_slot=sizes.num_slots - 1,
            scratch_page=sizes.num_blocks - 1,
            # no bucket above what one pass may hold
            buckets=token_buckets(min(self.config.runner.prefill_graph_max_tokens, self.config.max_num_batched_tokens)),
            with_captures=sizes.num_snapshots > 0,
            device=self.device,
            kernels=self.kernels,
            capture=capture,
            graph_pool=self.graphs.pool if self.graphs is not None else None,
        )

    def _capture_verify_graphs(self):
        """The speculative verify CUDA graphs (None on CPU, with graphs off or without speculation)."""
        if self.device.type != "cuda" or self.config.runner.enforce_eager or self.spec is None:
            return None
        from deltaserve.workers.cuda_graph import DEFAULT_BATCH_SIZES
        from deltaserve.workers.spec_graphs import VerifyGraphs

        sizes, k = self.sizes, self.spec.k
        max_len = self.model_config.max_position_embeddings + 2 * k
        largest = min(self.config.max_num_seqs, self.config.runner.cuda_graph_max_batch)
        batch_sizes = tuple(b for b in DEFAULT_BATCH_SIZES if b <= largest)
        try:
            graphs = VerifyGraphs(
                self.model,
                self.spec,
                max_pages=min(sizes.num_blocks, -(-max_len // sizes.block_size)),
                scratch_slot=sizes.num_slots - 1,
                scratch_page=sizes.num_blocks - 1,
                batch_sizes=batch_sizes,
                device=self.device,
                kernels=self.kernels,
            )
        except Exception:  # serving goes on eagerly; tests/test_gpu_spec_decode.py asserts the graphs exist
            log.exception("capturing the speculative verify CUDA graphs failed: verify passes run eagerly")
            torch.cuda.synchronize(self.device)
            return None
        return graphs if graphs.batch_sizes else None

    @during_startup  # the graphs' captures under the new options
    def set_kernel_options(self, kernels: KernelOptions) -> None:
        """Run later passes with these kernel choices (the benchmark's variants); the decode graphs,
        which replay the kernels of their capture, are captured again under them. Nothing may be
        in flight."""
        self.kernels = kernels
        self.sampler.pdl = kernels.pdl
        held = self.graphs or self.verify_graphs or self.prefill_graphs
        if held is None or held.kernels == kernels:
            return
        torch.cuda.synchronize(self.device)
        self.graphs = self.verify_graphs = self.prefill_graphs = None
        torch.cuda.empty_cache()
        self.graphs = self._capture_graphs()
        self.verify_graphs = self._capture_verify_graphs()
        self.prefill_graphs = self._capture_prefill_graphs()

    # ---- one pass ----------------------------------------------------------------------------
    def _forward(self, plan: PassPlan, pool: StatePool, prev_tokens: torch.Tensor | None = None):
        """(logits of the plan's logits rows, their spans, (context, final hidden states) or None when
        a graph ran)."""
        indices, spans = logits_rows(plan)
        route = self.lora.route(plan.lora_slots) if self.lora is not None else None
        if self.graphs is not None and pool is self.pool and self.graphs.can_run(plan):
            return self.graphs.run(plan, prev_tokens), spans, None
        if self.prefill_graphs is not None and pool is self.pool and self.prefill_graphs.can_run(plan):
            return self.prefill_graphs.run(plan, indices), spans, None
        ctx = build_forward_context(
            plan, self.model_config, self.layout, self.device, indices, prev_tokens, kernels=self.kernels,
            num_lora_slots=self.num_lora_slots, moe_lora_route=route or MoeLoraRoute.SKIP,
        )  # fmt: skip
        with torch.inference_mode():
            hidden = self.model(ctx, pool.layer_states)
            logits = self.model.compute_logits(hidden[ctx.logits_indices]) if len(indices) else None
        return logits, spans, (ctx, hidden)

    @property
    def num_lora_slots(self) -> int:
        return 0 if self.lora is None else self.lora.num_slots

    def execute(self, plan: PassPlan) -> RunnerOutput | None:
        """Run one pass and wait for its output (None on ranks other than TP rank 0)."""
        return self.execute_async(plan).result()

    def execute_async(self, plan: PassPlan) -> PassOutput:
        """Launch one pass; nothing here waits for the device (on CPU the pass simply runs)."""
        started = time.perf_counter()
        check_plan_ranges(plan, self.sizes, self.model_config.vocab_size, self.num_lora_slots)
        for spec in plan.grammars:  # compiles start now, in the background
            self.sampler.prepare_grammar(spec)
        prev = self._prev
        held = (None, 0) if prev is None else (prev.pass_id, prev.tokens.shape[0])
        prev_tokens = prev.tokens if check_prev_ids(plan, *held) else None
        check_spec_engine(plan, self.config.runner.num_speculative_tokens)
        # only the previous pass may still be unread when this one samples; with speculation none (a
        # verify's accepted count moves its requests' draw counters)
        while len(self._unresolved) > (0 if self.spec is not None else 1):
            self._resolve_oldest()
        for req_id in plan.finished_req_ids:
            self.sampler.remove(req_id)
        for data in plan.new_requests:
            self.sampler.add(data)
        if plan.lora_loads:
            self.lora.place(plan.lora_loads)
        events = self._start_events()
        self._copy_state(plan)
        if (
            self.verify_graphs is not None
            and self.verify_graphs.can_run(plan)
            and self.sampler.is_plain_greedy(plan.req_ids)
        ):
            return self._graphed_verify(plan, started, events)
        logits, spans, forward = self._forward(plan, self.pool, prev_tokens)
        # every TP rank samples (its logits are the full vocabulary after the all-gather, and its
        # sampler sees the same plans, seeds and counters): the next plan may read its decode input
        # ids from these sampled ids on any rank. Only rank 0 computes logprobs and returns outputs.
        driver = self.is_driver_rank
        copy = HostCopy(self.device)
        from_prev = plan.input_from_prev if prev_tokens is not None else None
        sample_ids, sample_rows, pending_rows, pending_src, prompt_parts = [], [], [], [], []
        for n, (first, count, sampled_at) in enumerate(spans):
            req_id = plan.req_ids[n]
            if sampled_at >= 0:
                if from_prev is not None and from_prev[n] >= 0:
                    pending_rows.append(len(sample_ids))
                    pending_src.append(int(from_prev[n]))
                sample_ids.append(req_id)
                sample_rows.append(sampled_at)
            if driver and plan.prompt_logprob_rows[n] and count:
                prompt_parts.append(self._prompt_logprobs(plan, n, logits[first : first + count], copy))
        batch = None
        if sample_ids and self._unresolved and self.sampler.needs_known_history(sample_ids):
            # a constrained row's latest token is in the previous pass's output: read it now, the
            # forward just launched keeps the device busy while the matchers advance
            while self._unresolved:
                self._resolve_oldest()
        if sample_ids:
            if sample_rows == list(range(logits.shape[0])):
                sampled_logits = logits
            else:
                (rows,) = upload([np.asarray(sample_rows)], self.device)
                sampled_logits = logits.index_select(0, rows)

            def pending_tokens() -> torch.Tensor:
                (src,) = upload([np.asarray(pending_src)], self.device)
                return prev_tokens.index_select(0, src)

            batch = self.sampler.sample_async(
                sample_ids, sampled_logits, copy, pending_rows, pending_tokens, logprobs=driver
            )
        verify = drafts = None
        if self.spec is not None:
            verify, drafts = self._speculate(plan, forward, logits, batch, spans, copy)
        if events is not None:  # before the copies' event, so the pass's own wait covers it
            events[2].record()
            self._last_pass_end = events[2]
        copy.record()
        tokens = batch.tokens if batch is not None else torch.zeros(0, dtype=torch.long, device=self.device)
        self._prev = PrevPass(plan.pass_id, tokens)
        handle = PassOutput(self, plan.pass_id, batch, copy, prompt_parts, started, events=events)
        handle.set_spec(verify, drafts, plan)
        self._unresolved.append(handle)
        return handle

    def _graphed_verify(self, plan: PassPlan, started: float, events) -> PassOutput:
        """A pass of greedy verify rows, the whole speculative step replayed from a CUDA graph."""
        copy = HostCopy(self.device)
        sampled, accepted, drafts = self.verify_graphs.run(plan)
        verify = self.sampler.verified(plan.req_ids, sampled, accepted, copy)
        drafts_slot = copy.add(drafts)
        if events is not None:
            events[2].record()
            self._last_pass_end = events[2]
        copy.record()
        self._prev = PrevPass(plan.pass_id, torch.zeros(0, dtype=torch.long, device=self.device))
        handle = PassOutput(self, plan.pass_id, None, copy, [], started, events=events)
        handle.set_spec(verify, drafts_slot, plan)
        self._unresolved.append(handle)
        return handle

    def _speculate(self, plan: PassPlan, forward, logits, batch: SampledBatch | None, spans, copy: HostCopy):
        """The verify rows' sampling and accepted counts, then write-on-accept, the MTP head's
        catch-up and the next drafts (workers/spec_decode.py). Returns (the VerifyBatch or None, the
        drafts' host-copy slot or None)."""
        ctx, hidden = forward
        nv = plan.num_decode_rows if plan.num_spec_tokens else 0
        verify = None
        with torch.inference_mode():
            if nv:
                tokens = nv * (plan.num_spec_tokens + 1)
                drafts = ctx.input_ids[:tokens].view(nv, -1)[:, 1:]
                if self._unresolved and self.sampler.constrained(plan.req_ids[:nv]):
                    while self._unresolved:  # a grammar's masks follow every token before the row
                        self._resolve_oldest()
                verify = self.sampler.sample_verify(
                    plan.req_ids[:nv],
                    logits[:tokens],
                    drafts,
                    copy,
                    logprobs=self.is_driver_rank,
                    host_drafts=np.asarray(plan.input_ids[:tokens]).reshape(nv, -1)[:, 1:],
                )
            index, j = [], 0
            for _, _, sampled_at in spans:
                index.append(j if sampled_at >= 0 else -1)
                j += sampled_at >= 0
            drafts = self.spec.after_sampling(
                plan,
                ctx,
                hidden,
                None if verify is None else verify.sampled,
                None if verify is None else verify.num_accepted,
                None if batch is None else batch.tokens,
                index,
            )
        return verify, (None if drafts is None else copy.add(drafts))

    def _copy_state(self, plan: PassPlan) -> None:
        """The plan's prefix-cache copies, before its forward: snapshot saves, then restores (a slot
        saved here may be handed to a resuming request in the same pass), then KV page copies."""
        for pairs, copy in (
            (plan.slot_saves, self.pool.copy_slots),
            (plan.slot_restores, self.pool.copy_slots),
            (plan.page_copies, self.pool.copy_pages),
        ):
            if pairs is not None and len(pairs):
                src, dst = upload([pairs[:, 0], pairs[:, 1]], self.device)
                copy(src, dst)

    def _start_events(self) -> tuple | None:
        """With runner.time_passes on CUDA: (previous pass's end event or None, this pass's start
        event, recorded now, and its end event, recorded after its last operation)."""
        if not (self.config.runner.time_passes and self.device.type == "cuda"):
            return None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        return self._last_pass_end, start, end

    def _prompt_logprobs(self, plan: PassPlan, row: int, logits: torch.Tensor, copy: HostCopy):
        """Logprob of each next prompt token within (and right after) the row's chunk (on the device)."""
        lo, hi = int(plan.query_start_loc[row]), int(plan.query_start_loc[row + 1])
        next_tokens = plan.input_ids[lo + 1 : hi].tolist()
        if plan.next_prompt_token is not None and plan.next_prompt_token[row] >= 0:
            next_tokens.append(int(plan.next_prompt_token[row]))
        k = self.sampler.states[plan.req_ids[row]].spec.prompt_logprobs or 0
        (tokens,) = upload([np.asarray(next_tokens, dtype=np.int64)], self.device)
        return plan.req_ids[row], LogprobParts(copy, tokens, logits[: len(next_tokens)], k), [k] * len(next_tokens)

    def _resolve_oldest(self) -> None:
        self._unresolved.popleft()._resolve()

    def drop_in_flight(self) -> None:
        """Forget the launched passes (their requests failed): no output of theirs will be read, and
        no later plan may read their sampled ids."""
        self._unresolved.clear()
        self._prev = None


class PassOutput:
    """A launched pass. `result()` waits for its host copies (after resolving every older pass, so
    that request histories grow in order) and returns its RunnerOutput (None off TP rank 0, which
    still resolves the pass: its sampler records the ids too). `done()` says, without waiting,
    whether `result()` would return at once (its copies are on the host; passes complete in order
    on the device)."""

    def __init__(
        self,
        runner: ModelRunner,
        pass_id: int,
        batch: SampledBatch | None,
        copy: HostCopy | None,
        prompt_parts: list,
        started: float,
        resolved: bool = False,
        events: tuple | None = None,
    ):
        self.pass_id = pass_id
        self._runner, self._batch, self._copy, self._prompt_parts = runner, batch, copy, prompt_parts
        self._started = started
        self._events = events
        self._resolved = resolved
        self._output: RunnerOutput | None = None
        self._verify = self._drafts = self._plan = None

    def set_spec(self, verify, drafts: int | None, plan: PassPlan) -> None:
        """A speculative pass's verify batch and the host-copy slot of its drafts."""
        if verify is not None or drafts is not None:
            self._verify, self._drafts, self._plan = verify, drafts, plan

    def done(self) -> bool:
        return self._resolved or self._copy is None or self._copy.ready()

    def result(self) -> RunnerOutput | None:
        queue = self._runner._unresolved
        while not self._resolved and queue:
            queue.popleft()._resolve()
        if not self._resolved:
            raise RuntimeError(f"pass {self.pass_id}'s output was dropped")
        return self._output

    def _resolve(self) -> None:
        out = RunnerOutput(pass_id=self.pass_id, req_ids=[], sampled_token_ids=[])
        for req_id, parts, ks in self._prompt_parts:
            out.prompt_logprobs[req_id] = parts.result(ks)
        if self._verify is not None:
            emitted, verify_logprobs = self._verify.result()
            out.req_ids = list(self._verify.req_ids)
            out.sampled_token_ids = [tokens[0] for tokens in emitted]
            out.extra_token_ids = {r: t[1:] for r, t in zip(out.req_ids, emitted, strict=True) if len(t) > 1}
            for req_id, entries in verify_logprobs.items():
                out.logprobs[req_id] = entries[0]
                if len(entries) > 1:
                    out.extra_logprobs[req_id] = entries[1:]
            out.grammar_errors = dict(self._verify.grammar_errors)
        if self._batch is not None:
            tokens, logprobs = self._batch.result()
            out.req_ids += list(self._batch.req_ids)
            out.sampled_token_ids += tokens
            out.logprobs.update(logprobs)
            out.grammar_errors = {**out.grammar_errors, **self._batch.grammar_errors}
        out.grammars_ready = self._runner.sampler.grammars.take_ready() if self._runner.is_driver_rank else {}
        if self._drafts is not None:
            drafting = [self._plan.req_ids[n] for n in np.flatnonzero(self._plan.draft_rows)]
            drafts = self._copy.get(self._drafts).tolist()
            if self._runner.is_driver_rank:  # the plan carries them to every rank
                drafts = self._runner.sampler.grammar_drafts(drafting, drafts)
            out.draft_token_ids = dict(zip(drafting, drafts, strict=True))
        if self._events is not None:
            previous, start, end = self._events
            end.synchronize()  # done already when the pass had host copies (recorded before their event)
            out.device_busy_s = start.elapsed_time(end) / 1e3
            out.device_gap_s = previous.elapsed_time(start) / 1e3 if previous is not None else -1.0
        out.forward_time_s = time.perf_counter() - self._started
        self._output = out if self._runner.is_driver_rank else None
        self._resolved = True
        self._batch = self._copy = self._prompt_parts = self._events = None
        self._verify = self._drafts = self._plan = None
