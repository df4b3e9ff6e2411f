"""EngineCore: requests in, RequestOutputs out, one pass per `step()`.

It owns the scheduler and the allocators, hands each PassPlan to an executor (the in-process
ModelRunner, or the Ray worker group), and turns the sampled tokens into text, stop decisions and
outputs. The same core runs under `LLM` (synchronously) and under the driver actor (in a loop).

Async scheduling (`SchedulerConfig.async_scheduling`: by default on wherever the executor can overlap
passes: the in-process runner, and the Ray worker group over its shared-memory ring): a step plans and launches pass
N+1 before it waits for pass N's tokens, then turns pass N's tokens into outputs while N+1 runs.
Pass N+1's decode rows for requests whose pass-N token is not known yet take their input id from
pass N's sampled ids on the device; a request that pass N's token finishes has its extra token of
pass N+1 discarded. Outputs are the synchronous engine's, one step later.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from deltaserve.cluster.config import EngineConfig
from deltaserve.cluster.executors.base import Executor, PassHandle, WorkerFailure, overlaps_passes
from deltaserve.layers.config import ModelConfig
from deltaserve.workers.config import short
from deltaserve.workers.grammar import parse_grammar
from deltaserve.workers.plan import GrammarSpec, PassPlan, RunnerOutput, TokenLogprobs

from .allocator import BlockAllocator, StateSlotAllocator
from .completions import CompletionGroup, completion_id
from .lora import AdapterRegistry, LoRARequest
from .prefix_cache import CapturePolicy, PrefixCache, SnapshotCache, cache_key_of
from .request import (
    CompletionOutput,
    FinishReason,
    Logprob,
    PromptLogprobs,
    Request,
    RequestMetrics,
    RequestOptions,
    RequestOutput,
    SampleLogprobs,
)
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .speculative import SpeculativeInfo
from .tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger(__name__)

OUTPUT_MODES = ("cumulative", "delta", "final")
CHECKED_GRAMMARS = 1024  # grammar keys known to parse, so that a repeated schema is not parsed again
SPEC_LOG_INTERVAL_S = 30.0  # how often the acceptance counters are logged while verifying
PREFIX_LOG_INTERVAL_S = 30.0  # how often the prefix cache's counters are logged while prompts arrive


@dataclass(frozen=True)
class ReplicaInfo:
    """Where one engine replica runs and how busy the router sees it."""

    index: int
    state: str  # up, suspect (not answering: takes no new requests), down, placing
    node_id: str  # the Ray node of its driver and workers ("" while placing; the process's own for local)
    node_ip: str
    transport: str  # how plans reach its workers: local (in the driver), shm, compiled
    in_flight: int
    routed: int  # requests routed to it since it started


@dataclass(frozen=True)
class ModelInfo:
    """What is served: the model, its limits, how it is split and the pools' capacity."""

    model: str
    model_type: str
    family: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    tensor_parallel_size: int
    expert_parallel: bool
    num_kv_pages: int
    block_size: int
    kv_tokens: int
    max_num_seqs: int
    dtype: str  # in use ("auto" resolved for the device)
    device: str
    speculative: SpeculativeInfo | None = None  # None: no speculative decoding
    data_parallel_size: int = 1
    replicas: tuple[ReplicaInfo, ...] = ()  # filled in by the front doors' engine (one entry per replica)


@dataclass(frozen=True)
class InFlightPass:
    """A pass launched by one step and applied by the next (async scheduling)."""

    plan: PassPlan
    handle: PassHandle


class EngineCore:
    """`output_mode`: "cumulative" (every output carries the whole completion so far), "delta"
    (unfinished outputs carry only what the step added: cheap to stream and to send between
    processes) or "final" (only finished requests produce outputs: offline generation)."""

    def __init__(
        self, config: EngineConfig, model_config: ModelConfig, executor: Executor, output_mode: str = "cumulative"
    ):
        if output_mode not in OUTPUT_MODES:
            raise ValueError(f"output_mode must be one of {OUTPUT_MODES}, got {output_mode!r}")
        self.output_mode = output_mode
        self.num_speculative_tokens = config.runner.num_speculative_tokens
        self.model_config = model_config
        model = config.load.model
        self.tokenizer = Tokenizer(model) if model is not None and (Path(model) / "tokenizer.json").is_file() else None
        self.executor = executor
        sizes = self.executor.pool_sizes
        cache = config.cache
        caching = cache.enable_prefix_caching and sizes.num_snapshots > 0
        if cache.enable_prefix_caching and not caching:
            log.warning("prefix caching is off: the memory budget leaves no room for a GDN state snapshot")
        self.blocks = BlockAllocator(sizes.num_blocks, sizes.block_size, enable_caching=caching)
        self.slots = StateSlotAllocator(sizes.num_slots)
        self.prefix_cache = (
            PrefixCache(
                self.blocks.cache,
                SnapshotCache(sizes.num_slots, sizes.num_snapshots, self.blocks.cache),
                CapturePolicy.parse(cache.prefix_snapshot_policy, cache.prefix_snapshot_interval),
            )
            if caching
            else None
        )
        limit = config.scheduler.max_model_len or model_config.max_position_embeddings
        fits = self.blocks.capacity * sizes.block_size
        if limit > fits:
            log.warning("max_model_len %d exceeds the %d tokens the KV pool holds; capping it", limit, fits)
            limit = fits
        self.max_model_len = limit
        self.config = config.replace(max_model_len=limit)
        scheduling = dataclasses.replace(
            self.config.scheduler, max_num_seqs=min(config.scheduler.max_num_seqs, self.slots.capacity)
        )
        self.loras = AdapterRegistry(config.lora, model_config)
        self.scheduler = Scheduler(
            scheduling, self.blocks, self.slots, self.prefix_cache, self.loras,
            num_speculative_tokens=self.num_speculative_tokens,
        )  # fmt: skip
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._prompts: dict[str, str | None] = {}
        # n > 1 requests by their id, and each completion's request id -> (its group, its index)
        self._groups: dict[str, CompletionGroup] = {}
        self._members: dict[str, tuple[CompletionGroup, int]] = {}
        self._checked_grammars: OrderedDict[str, None] = OrderedDict()
        self._grammar_lock = threading.Lock()  # make_request runs on the callers' threads too
        # speculative passes run synchronously: a verify's accepted count decides the next plan
        self.async_scheduling = not self.num_speculative_tokens and overlaps_passes(
            self.executor, config.scheduler.async_scheduling
        )
        self._in_flight: InFlightPass | None = None  # the launched pass not yet applied
        self._restart_pending = False  # a worker died: the next step replaces the group first
        self._spec_logged = time.monotonic()
        self._prefix_logged = (time.monotonic(), 0)  # when, and the lookups counted then
        # with runner.time_passes on a GPU: (device busy s, device idle before it s) of recent passes
        self.pass_device_times: deque[tuple[float, float]] = deque(maxlen=4096)
        log.info(
            "engine ready: %d KV tokens (%d pages of %d, %s), %d sequences, max_model_len %d, async scheduling %s",
            sizes.num_blocks * sizes.block_size,
            sizes.num_blocks,
            sizes.block_size,
            "fp8 e4m3" if self.config.cache.kv_fp8 else "the model's dtype",
            self.scheduler.config.max_num_seqs,
            limit,
            "on" if self.async_scheduling else "off",
        )

    # ---- requests ----------------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("prompt: text prompts need a tokenizer.json in the model directory")
        return self.tokenizer.encode(text)

    def make_request(
        self,
        req_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        tokenized: Request | None = None,
    ) -> Request:
        """Validate and build a request (raises ValueError naming the bad field); queues nothing.
        cache_salt: requests share prefix-cache entries only with requests of the same salt.
        lora_request: the adapter it runs on (registered and checked on first use). priority: lower
        first, under scheduling_policy="priority" (fcfs takes only 0, as vLLM). tokenized: a request
        this engine made from the same prompt (the engine loop's submit, on the caller's thread): its
        checked ids are taken as they are, not tokenized and checked again."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: must be a SamplingParams, got {type(params).__name__}")
        RequestOptions(priority=priority, cache_salt=cache_salt).check()
        if priority and self.config.scheduler.scheduling_policy != "priority":
            raise ValueError("priority: only 0 unless the engine runs with scheduling_policy='priority'")
        params.validate(self.model_config.vocab_size)
        if tokenized is not None:
            ids, prompt_array = list(tokenized.prompt_token_ids), tokenized.prompt_array
        else:
            ids, prompt_array = self._prompt_ids(prompt)
        room = self.max_model_len - len(ids)
        if room < 1:
            raise ValueError(
                f"prompt: {len(ids)} tokens leave no room to generate within max_model_len={self.max_model_len}"
            )
        max_tokens = room if params.max_tokens is None else params.max_tokens
        if max_tokens > room:
            raise ValueError(
                f"max_tokens: {short(max_tokens)} after a {len(ids)}-token prompt exceeds"
                f" max_model_len={self.max_model_len}"
                f" (at most {room} fit; None asks for as many as fit)"
            )
        if params.min_tokens > room:
            raise ValueError(f"min_tokens: {short(params.min_tokens)} after a {len(ids)}-token prompt exceeds {room}")
        grammar = self._check_grammar(params)
        adapter = self.loras.resolve(lora_request)
        req = Request(
            req_id,
            ids,
            params,
            max_tokens,
            eos_token_ids=self.model_config.eos_token_ids,
            lora=adapter,
            grammar=grammar,
            priority=priority,
            prompt_array=prompt_array,
        )
        # requests on different adapters (or none) never share cached blocks or GDN snapshots
        req.cache_key = cache_key_of(adapter.cache_key if adapter is not None else None, cache_salt)
        return req

    def _prompt_ids(self, prompt: str | list[int]) -> tuple[list[int], np.ndarray]:
        """The prompt's ids, checked, and as int32 (ValueError naming the field)."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            ids = self.tokenize(prompt)
        elif isinstance(prompt, list | tuple):
            ids = list(prompt)
        else:
            raise ValueError(f"prompt: must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt: must not be empty")
        return ids, _check_token_ids(ids, self.model_config.vocab_size)

    def _check_grammar(self, params: SamplingParams) -> GrammarSpec | None:
        """The request's constraint, checked to compile (xgrammar parses it: milliseconds; the
        compile against the vocabulary runs on the workers); ValueError naming the field."""
        if params.structured_outputs is None:
            return None
        if self.tokenizer is None:
            raise ValueError("structured_outputs: needs the model's tokenizer.json, and this model has none")
        spec = params.structured_outputs.to_grammar_spec()
        with self._grammar_lock:
            if spec.key in self._checked_grammars:
                self._checked_grammars.move_to_end(spec.key)
                return spec
        parse_grammar(spec)
        with self._grammar_lock:
            self._checked_grammars[spec.key] = None
            while len(self._checked_grammars) > CHECKED_GRAMMARS:
                self._checked_grammars.popitem(last=False)
        return spec

    def add_request(
        self,
        req_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        tokenized: Request | None = None,
    ) -> Request:
        """Validate and queue a request (ValueError naming a bad field, or an id in use). n > 1: its
        completions queue as requests of their own (completions.py); returns the first. tokenized:
        make_request's."""
        if req_id in self._groups:
            raise ValueError(f"request_id: {short(req_id, 80)} is already in use")
        made = (cache_salt, lora_request, priority, tokenized)
        if params.n == 1:
            return self._queue(self.make_request(req_id, prompt, params, *made), prompt)
        first = self.make_request(completion_id(req_id, 0), prompt, params.for_completion(0), *made)
        ids = [completion_id(req_id, i) for i in range(params.n)]
        if any(i in self.scheduler.requests for i in ids):
            raise ValueError(f"request_id: {short(req_id, 80)} is already in use")
        group = CompletionGroup(req_id, params.n, prompt if isinstance(prompt, str) else None)
        self._groups[req_id] = group
        reqs = [first] + [
            self.make_request(
                ids[i], first.prompt_token_ids, params.for_completion(i), cache_salt, lora_request, priority
            )
            for i in range(1, params.n)
        ]
        for i, req in enumerate(reqs):
            req.prefill_leader = first if i else None
            self._members[req.req_id] = (group, i)
            self._queue(req, prompt)
        return first

    def _queue(self, req: Request, prompt: str | list[int]) -> Request:
        self.scheduler.add(req)
        self._prompts[req.req_id] = prompt if isinstance(prompt, str) else None
        params = req.sampling_params
        if self.tokenizer is not None:
            self._detok[req.req_id] = IncrementalDetokenizer(
                self.tokenizer,
                req.prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
        return req

    # ---- adapters ------------------------------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register an adapter (checked against the model: ValueError naming the file and field)."""
        self.loras.add(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unregister an adapter; requests running on it finish on it."""
        return self.loras.remove(lora_int_id)

    def list_loras(self) -> list[LoRARequest]:
        return self.loras.list()

    def lora_request(self, name: str) -> LoRARequest | None:
        """The registered adapter of this name, or None (front doors answer NOT_FOUND)."""
        return self.loras.lookup(name)

    def abort(self, req_id: str) -> RequestOutput | None:
        """End a request (an n > 1 request: every completion still running); its last output, None
        when no such request runs."""
        group = self._groups.get(req_id)
        if group is None:
            req = self.scheduler.abort(req_id)
            return None if req is None else self._output(req, [], "")
        out = None
        for i in range(group.n):
            req = self.scheduler.abort(completion_id(req_id, i))
            if req is not None:
                out = self._output(req, [], "") or out
        return out

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None or self._restart_pending

    # ---- one pass ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one pass: synchronously, or (async scheduling) launch the next pass and then apply the
        one launched by the previous step."""
        if self._restart_pending:
            self._replace_workers()
        if self.async_scheduling:
            return self._step_async()
        plan = self.scheduler.schedule()
        outputs = self._outputs_of(self.scheduler.pop_failed())
        if plan is None:
            return outputs
        try:
            handle = self.executor.execute_async(plan)
            self.scheduler.register_planned_blocks()  # host work while the pass runs
            result = handle.result()
        except WorkerFailure as e:
            return outputs + self._on_worker_failure(e)
        return outputs + self._apply(plan, result)

    def _step_async(self) -> list[RequestOutput]:
        # plan and launch pass N+1 while pass N (launched by the previous step) still runs
        plan = self.scheduler.schedule()
        outputs = self._outputs_of(self.scheduler.pop_failed())
        launched = None
        if plan is not None:
            try:
                launched = InFlightPass(plan, self.executor.execute_async(plan))
            except WorkerFailure as e:
                return outputs + self._on_worker_failure(e)
            self.scheduler.register_planned_blocks()  # host work while the pass runs
        previous, self._in_flight = self._in_flight, launched
        if previous is not None:
            # then wait for pass N's tokens and turn them into outputs while pass N+1 runs
            try:
                result = previous.handle.result()
            except WorkerFailure as e:
                return outputs + self._on_worker_failure(e)
            outputs += self._apply(previous.plan, result)
        return outputs

    def set_async_scheduling(self, enabled: bool) -> list[RequestOutput]:
        """Switch between overlapped and synchronous passes (benchmarks compare the two); the pass in
        flight, if any, is finished first and its outputs returned."""
        outputs: list[RequestOutput] = []
        if self._in_flight is not None:
            previous, self._in_flight = self._in_flight, None
            try:
                outputs = self._apply(previous.plan, previous.handle.result())
            except WorkerFailure as e:
                outputs = self._on_worker_failure(e)
        self.async_scheduling = enabled and not self.num_speculative_tokens and overlaps_passes(self.executor)
        return outputs

    def _apply(self, plan: PassPlan, result: RunnerOutput) -> list[RequestOutput]:
        if result.device_gap_s >= 0:
            self.pass_device_times.append((result.device_busy_s, result.device_gap_s))
        outputs = []
        for req, count in self.scheduler.apply_output(plan, result):
            out = self._on_tokens(req, count)
            if out is not None:
                outputs.append(out)
        # requests the output failed (a grammar that did not compile on the workers)
        outputs += self._outputs_of(self.scheduler.pop_failed())
        self._log_spec_stats()
        self._log_prefix_stats()
        return outputs

    def _on_worker_failure(self, e: WorkerFailure) -> list[RequestOutput]:
        """Fail every request now (their clients hear of it at once, not after the restart); the next
        step replaces the worker group, and requests added meanwhile wait for it."""
        log.error("%s; failing %d requests and restarting the workers", e, len(self.scheduler.requests))
        self._restart_pending = True
        return self.fail_all(str(e))

    def _replace_workers(self) -> None:
        self._restart_pending = False
        self.executor.restart()
        # the new workers' pools hold none of the cached pages and snapshots the index names, nor
        # adapters, and they have compiled no grammar
        self.scheduler.reset_prefix_cache()
        self.scheduler.reset_grammars()
        self.loras.reset_device()
        # a restarted group may use another transport (no overlap over a compiled graph)
        self.async_scheduling = self.async_scheduling and overlaps_passes(self.executor)

    def fail_all(self, error: str) -> list[RequestOutput]:
        """End every queued and running request with an error (a worker died); the passes in flight
        are dropped."""
        self._in_flight = None
        self.scheduler.forget_in_flight()
        requests = list(self.scheduler.running) + list(self.scheduler.waiting)
        for req in requests:
            self.scheduler.finish(req, FinishReason.ERROR, error)
        return self._outputs_of(requests)

    def _on_tokens(self, req: Request, count: int) -> RequestOutput | None:
        """The request's last `count` tokens (several from a speculative verify) into text; a stop
        string ends the request at the token that completed it (later ones are dropped)."""
        new = req.output_token_ids[len(req.output_token_ids) - count :]
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        delta = ""
        detok = self._detok.get(req.req_id)
        if detok is not None:
            for i, token in enumerate(new):
                delta += detok.add([token])
                if detok.stopped_by is not None:
                    later = len(new) - i - 1
                    if later:  # the scheduler may have ended it on one of them: the string came first
                        del req.output_token_ids[-later:]
                        del req.logprobs[len(req.logprobs) - min(later, len(req.logprobs)) :]
                        new = new[: i + 1]
                        req.finish_reason = FinishReason.STOP if req.is_finished else req.finish_reason
                    if not req.is_finished or later:
                        req.stop_reason = detok.stopped_by
                    if not req.is_finished:
                        self.scheduler.finish(req, FinishReason.STOP)
                    break
        if req.is_finished:
            delta += self._flush(req)
        elif self.output_mode == "final":
            return None
        return self._output(req, new, delta)

    def _flush(self, req: Request) -> str:
        detok = self._detok.get(req.req_id)
        return "" if detok is None else detok.flush()

    def _outputs_of(self, finished: list[Request]) -> list[RequestOutput]:
        """The outputs of requests just ended outside a pass (failed, or their workers lost)."""
        outputs = (self._output(req, [], self._flush(req)) for req in finished)
        return [out for out in outputs if out is not None]

    def _output(self, req: Request, new_ids: list[int], delta: str) -> RequestOutput | None:
        """The request's output, or (a completion of an n > 1 request) its share of the request's:
        None while the final-only request waits for other completions."""
        out = self._request_output(req, new_ids, delta)
        member = self._members.get(req.req_id)
        if member is None:
            return out
        group, index = member
        if out.finished:
            del self._members[req.req_id]
        gathered = group.gather(index, out, final_only=self.output_mode == "final")
        if group.done:
            del self._groups[group.req_id]
        return gathered

    def _request_output(self, req: Request, new_ids: list[int], delta: str) -> RequestOutput:
        """The request's output; lists are the request's own (it is not mutated once finished)."""
        finished = req.is_finished
        params = req.sampling_params
        want_logprobs = params.logprobs is not None
        logprobs = self._sample_logprobs(req) if want_logprobs else None
        if finished or self.output_mode == "cumulative":
            detok = self._detok.get(req.req_id)
            completion = CompletionOutput(
                index=0,
                text=detok.text[: detok.emitted] if detok is not None else "",
                token_ids=req.output_token_ids,
                cumulative_logprob=sum(lp.logprob for lp in req.logprobs) if want_logprobs else None,
                logprobs=logprobs,
                finish_reason=req.finish_reason.value if finished else None,
                stop_reason=req.stop_reason,
            )
            prompt_logprobs = self._prompt_logprobs(req) if params.prompt_logprobs is not None else None
        else:
            completion = CompletionOutput(
                index=0, text="", token_ids=[], cumulative_logprob=None, logprobs=None, finish_reason=None
            )
            # as vLLM's delta outputs: the prompt's logprobs with the first tokens (all known by then)
            first = bool(new_ids) and len(req.output_token_ids) == len(new_ids)
            prompt_logprobs = self._prompt_logprobs(req) if first and params.prompt_logprobs is not None else None
        out = RequestOutput(
            request_id=req.req_id,
            prompt=self._prompts.get(req.req_id),
            prompt_token_ids=req.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=[completion],
            finished=finished,
            num_cached_tokens=req.num_cached_tokens or 0,
            metrics=RequestMetrics(
                arrival_time=req.arrival_time,
                first_scheduled_time=req.first_scheduled_time,
                first_token_time=req.first_token_time,
                finished_time=time.monotonic() if finished else None,
            )
            if finished
            else None,
            delta_text=delta,
            delta_token_ids=new_ids,
            delta_logprobs=logprobs[len(logprobs) - len(new_ids) :] if want_logprobs and new_ids else [],
            time_to_first_token_s=None if req.first_token_time is None else req.first_token_time - req.arrival_time,
            error=req.error,
        )
        if finished:
            self._detok.pop(req.req_id, None)
            self._prompts.pop(req.req_id, None)
        return out

    # ---- logprobs in vLLM's shape -------------------------------------------------------------
    def _sample_logprobs(self, req: Request) -> SampleLogprobs:
        """req.logprobs as vLLM's dicts, converting only the positions not converted before."""
        out = req.sample_logprobs_out
        for lp in req.logprobs[len(out) :]:
            out.append(self._logprob_entry(lp))
        return out

    def _prompt_logprobs(self, req: Request) -> PromptLogprobs:
        out = req.prompt_logprobs_out
        for lp in req.prompt_logprobs[len(out) :]:
            out.append(None if lp is None else self._logprob_entry(lp))
        return out

    def _logprob_entry(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        """{chosen token: its Logprob, then the top k by rank}; the chosen token, when among the top k,
        is one entry (first) with its top-k value, as vLLM builds it."""
        ids = [lp.token_id, *lp.top_ids]
        texts = self.tokenizer.decode_each(ids) if self.tokenizer is not None else [None] * len(ids)
        entry = {lp.token_id: Logprob(lp.logprob, lp.rank, texts[0])}
        for rank, (token, value, text) in enumerate(zip(lp.top_ids, lp.top_logprobs, texts[1:], strict=True), 1):
            entry[token] = Logprob(value, rank, text)
        return entry

    def model_info(self) -> ModelInfo:
        cfg, mc = self.config, self.model_config
        return ModelInfo(
            model=cfg.load.model or "",
            model_type=mc.model_type,
            family=mc.family,
            max_model_len=self.max_model_len,
            vocab_size=mc.vocab_size,
            eos_token_ids=tuple(mc.eos_token_ids),
            tensor_parallel_size=cfg.parallel.tensor_parallel_size,
            expert_parallel=cfg.parallel.enable_expert_parallel,
            num_kv_pages=self.blocks.capacity,
            block_size=self.blocks.block_size,
            kv_tokens=self.blocks.capacity * self.blocks.block_size,
            max_num_seqs=self.scheduler.config.max_num_seqs,
            dtype=cfg.load.dtype_in_use,
            device=cfg.load.device,
            speculative=None if self.scheduler.spec_stats is None else self.scheduler.spec_stats.info(),
        )

    def prefix_events(self) -> deque[tuple[bool, bytes]] | None:
        """Record the page index's changes from now on, for a router's PrefixMirror (the reader drains
        the deque); None without a prefix cache."""
        if self.prefix_cache is None:
            return None
        pages = self.prefix_cache.pages
        if pages.events is None:
            pages.events = deque()
        return pages.events

    def set_prefix_caching(self, enabled: bool) -> None:
        """Use the prefix cache or not (benchmarks compare both in one process); the index is kept."""
        if self.prefix_cache is None:
            if enabled:
                raise ValueError("enable_prefix_caching: this engine was built without a prefix cache")
            return
        self.scheduler.set_prefix_cache(self.prefix_cache if enabled else None)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block and GDN snapshot; requests in flight keep what they hold."""
        return self.scheduler.reset_prefix_cache()

    def speculative_stats(self) -> dict:
        """Drafts proposed and accepted (per position too) and the mean acceptance length."""
        stats = self.scheduler.spec_stats
        if stats is None:
            return {"enabled": False}
        return {"enabled": True, "method": "mtp", **stats.as_dict()}

    def _log_spec_stats(self) -> None:
        stats = self.scheduler.spec_stats
        now = time.monotonic()
        if stats is None or not stats.num_drafts or now - self._spec_logged < SPEC_LOG_INTERVAL_S:
            return
        self._spec_logged = now
        rates = ", ".join(f"{r:.2f}" for r in stats.as_dict()["acceptance_rate_per_position"])
        log.info(
            "speculative decoding: %d verify rows, %d of %d drafts accepted, mean acceptance length %.2f, "
            "acceptance by position [%s]",
            stats.num_drafts,
            stats.num_accepted_tokens,
            stats.num_draft_tokens,
            stats.mean_acceptance_length,
            rates,
        )

    def _log_prefix_stats(self, now: float | None = None) -> None:
        """Every PREFIX_LOG_INTERVAL_S while new prompts were looked up: the cache's counters."""
        if self.prefix_cache is None:
            return
        now = time.monotonic() if now is None else now
        stats = self.prefix_cache.stats
        last, queries = self._prefix_logged
        if stats.queries == queries or now - last < PREFIX_LOG_INTERVAL_S:
            return
        self._prefix_logged = (now, stats.queries)
        info = self.prefix_cache_stats()
        log.info(
            "prefix cache: %d blocks cached, %d of %d snapshots held, %d of %d prompts hit, %.1f%% of prompt "
            "tokens skipped, %d snapshots taken, %d evicted",
            info["blocks_cached"],
            info["snapshots_held"],
            info["snapshot_slots"],
            info["hits"],
            info["queries"],
            100 * info["hit_rate"],
            info["snapshots_taken"],
            info["snapshots_evicted"],
        )

    def prefix_cache_stats(self) -> dict:
        if self.prefix_cache is None:
            return {"enabled": False}
        stats = self.prefix_cache.stats
        return {
            "enabled": True,
            "blocks_cached": self.prefix_cache.pages.num_cached,
            "snapshots_held": len(self.prefix_cache.snapshots),
            "snapshot_slots": self.prefix_cache.snapshots.count,
            "hit_rate": stats.hit_rate,
            "queries": stats.queries,
            "hits": stats.hits,
            "hit_tokens": stats.hit_tokens,
            "query_tokens": stats.query_tokens,
            "snapshots_taken": stats.snapshots_taken,
            "snapshots_evicted": stats.snapshots_evicted,
        }

    def shutdown(self) -> None:
        self.executor.shutdown()


def _check_token_ids(ids: list, vocab: int) -> np.ndarray:
    """Every id a plain int in [0, vocab) (a long prompt's resend: the types in C, the range on an
    array, not a loop per token); returns them as int32 (the plan's and the block hashes' form), else
    ValueError naming the first bad one."""
    if set(map(type, ids)) == {int}:
        try:
            arr = np.fromiter(ids, dtype=np.int64, count=len(ids))
        except OverflowError:  # an id past int64: the loop below names it
            arr = None
        if arr is not None and arr.min() >= 0 and arr.max() < vocab:
            return arr.astype(np.int32)
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
            raise ValueError(f"prompt_token_ids: token id {short(t)} is outside the vocabulary [0, {vocab})")
    raise AssertionError("unreachable: a prompt that fails the fast check has a bad id")
