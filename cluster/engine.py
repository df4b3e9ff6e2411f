"""EngineCore: requests in, RequestOutputs out, one pass per `step()`.

It owns the scheduler and the allocators, hands each PassPlan to an executor (the in-process
ModelRunner, or the Ray worker group), and turns the sampled tokens into text, stop decisions and
outputs. The same core runs under `LLM` (synchronously) and under the driver actor (in a loop).

Async scheduling (`EngineConfig.async_scheduling`: by default on wherever the executor can overlap
passes: the in-process runner, and the Ray worker group over its shared-memory ring): a step plans and launches pass
N+1 before it waits for pass N's tokens, then turns pass N's tokens into outputs while N+1 runs.
Pass N+1's decode rows for requests whose pass-N token is not known yet take their input id from
pass N's sampled ids on the device; a request that pass N's token finishes has its extra token of
pass N+1 discarded. Outputs are the synchronous engine's, one step later.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from deltaserve.layers.config import ModelConfig

from .allocator import BlockAllocator, StateSlotAllocator
from .plan import PassPlan, RunnerOutput
from .prefix_cache import CapturePolicy, PrefixCache, SnapshotCache
from .request import CompletionOutput, FinishReason, Request, RequestOutput
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerConfig
from .tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    model: str | None
    dtype: str = "auto"
    device: str = "cpu"
    load_format: str = "auto"
    seed: int = 0
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_bytes: int = 256 * 2**20
    num_kv_blocks: int | None = None  # exact KV page count, overriding the memory budget
    # the gateway answers RESOURCE_EXHAUSTED beyond this many waiting requests
    max_waiting_requests: int = 1024
    enable_cuda_graphs: bool = True  # decode passes replay captured CUDA graphs
    # plan and launch pass N+1 before pass N's tokens are back (executors that overlap passes: the
    # local one, and the Ray executor over "shm"; its "compiled" and "calls" transports run passes
    # synchronously whatever this says)
    # None or True: wherever supported (measured on one H200 and on two with TP = 2); False: never
    async_scheduling: bool | None = None
    # CUDA events around each pass on the device (benchmarks): each RunnerOutput then says how long
    # the pass kept the GPU busy and how long the GPU sat idle between the previous pass and it
    time_passes: bool = False
    # "local": the model in this process (TP = 1 only); "ray": worker actors; "auto": local when TP = 1
    executor: str = "auto"
    # prefix caching: KV pages by block hash, GDN state by snapshot (cluster/prefix_cache.py)
    enable_prefix_caching: bool = True
    num_prefix_snapshots: int | None = None  # snapshot slots (None: what 10% of the pool budget holds)
    prefix_snapshot_interval: int = 1024  # tokens between snapshots along a prefill
    prefix_snapshot_policy: str = "all"  # or a comma list of prompt_end, last_block, divergence, finish, interval

    def validate(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size: must be >= 1, got {self.tensor_parallel_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens: must be >= 1, got {self.max_num_batched_tokens}")
        if self.block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {self.block_size}")
        if self.executor not in ("auto", "local", "ray"):
            raise ValueError(f"executor: must be auto, local or ray; got {self.executor!r}")
        if self.executor == "local" and (self.tensor_parallel_size > 1 or self.enable_expert_parallel):
            raise ValueError("executor: 'local' runs one rank; tensor or expert parallelism needs 'ray'")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.prefix_snapshot_interval < 0 or self.prefix_snapshot_interval % self.block_size:
            raise ValueError(
                f"prefix_snapshot_interval: must be a non-negative multiple of block_size ({self.block_size}), "
                f"got {self.prefix_snapshot_interval}"
            )
        if self.num_prefix_snapshots is not None and self.num_prefix_snapshots < 0:
            raise ValueError(f"num_prefix_snapshots: must be >= 0, got {self.num_prefix_snapshots}")
        CapturePolicy.parse(self.prefix_snapshot_policy, self.prefix_snapshot_interval)


class WorkerFailure(RuntimeError):
    """A worker of the group died or failed a pass; the requests in flight are lost."""


class Executor(Protocol):
    """Runs pass plans on the model's ranks; `pool_sizes` is what the workers allocated. An executor
    that can launch a pass without waiting for it also has `execute_async(plan)`, returning an
    object whose `result()` waits for the RunnerOutput (async scheduling uses it when present and
    the executor's optional `supports_async` is not False; see `overlaps_passes`)."""

    pool_sizes: object

    def execute(self, plan: PassPlan) -> RunnerOutput: ...

    def restart(self) -> None: ...

    def shutdown(self) -> None: ...


class LocalExecutor:
    """The whole model in this process (TP = 1)."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig):
        from deltaserve.workers.runner import ModelRunner

        self.runner = ModelRunner(runner_config(config), model_config)
        self.runner.allocate(self.runner.sizes)
        self.pool_sizes = self.runner.sizes

    def execute(self, plan: PassPlan) -> RunnerOutput:
        return self.runner.execute(plan)

    def execute_async(self, plan: PassPlan):
        """Launch the pass; `.result()` of the returned PassOutput waits for its RunnerOutput."""
        return self.runner.execute_async(plan)

    def restart(self) -> None:
        # an in-process runner cannot die separately from the engine; the passes in flight are void
        self.runner.drop_in_flight()

    def shutdown(self) -> None:
        self.runner = None


def overlaps_passes(executor, requested: bool | None = True) -> bool:
    """Whether passes overlap on this executor: it has `execute_async`, its `supports_async` (the Ray
    executor: True over the shared-memory ring only), if any, is true, and overlap was not turned off
    (`requested` False)."""
    if requested is False:
        return False
    return hasattr(executor, "execute_async") and bool(getattr(executor, "supports_async", True))


def runner_config(config: EngineConfig):
    from deltaserve.workers.runner import RunnerConfig

    return RunnerConfig(
        model=config.model,
        dtype=config.dtype,
        device=config.device,
        load_format=config.load_format,
        seed=config.seed,
        block_size=config.block_size,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        gpu_memory_utilization=config.gpu_memory_utilization,
        cpu_kv_cache_bytes=config.cpu_kv_cache_bytes,
        num_kv_blocks=config.num_kv_blocks,
        enable_cuda_graphs=config.enable_cuda_graphs,
        time_passes=config.time_passes,
        num_prefix_snapshots=config.num_prefix_snapshots if config.enable_prefix_caching else 0,
    )


def make_executor(config: EngineConfig, model_config: ModelConfig) -> Executor:
    single = config.tensor_parallel_size == 1 and not config.enable_expert_parallel
    if config.executor == "local" or (config.executor == "auto" and single):
        return LocalExecutor(config, model_config)
    from .ray_executor import RayExecutor

    return RayExecutor(config, model_config)


OUTPUT_MODES = ("cumulative", "delta", "final")


class EngineCore:
    """`output_mode`: "cumulative" (every output carries the whole completion so far), "delta"
    (unfinished outputs carry only what the step added: cheap to stream and to send between
    processes) or "final" (only finished requests produce outputs: offline generation)."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig | None = None,
        executor: Executor | None = None,
        output_mode: str = "cumulative",
    ):
        config.validate()
        if output_mode not in OUTPUT_MODES:
            raise ValueError(f"output_mode must be one of {OUTPUT_MODES}, got {output_mode!r}")
        self.output_mode = output_mode
        if model_config is None:
            if config.model is None:
                raise ValueError("model: a model directory is required")
            model_config = ModelConfig.from_pretrained(config.model)
        self.model_config = model_config
        has_tokenizer = config.model is not None and (Path(config.model) / "tokenizer.json").is_file()
        self.tokenizer = Tokenizer(config.model) if has_tokenizer else None
        self.executor = executor or make_executor(config, model_config)
        sizes = self.executor.pool_sizes
        caching = config.enable_prefix_caching and sizes.num_snapshots > 0
        if config.enable_prefix_caching and not caching:
            log.warning("prefix caching is off: the memory budget leaves no room for a GDN state snapshot")
        self.blocks = BlockAllocator(sizes.num_blocks, sizes.block_size, enable_caching=caching)
        self.slots = StateSlotAllocator(sizes.num_slots)
        self.prefix_cache = (
            PrefixCache(
                self.blocks.cache,
                SnapshotCache(sizes.num_slots, sizes.num_snapshots, self.blocks.cache),
                CapturePolicy.parse(config.prefix_snapshot_policy, config.prefix_snapshot_interval),
            )
            if caching
            else None
        )
        limit = config.max_model_len or model_config.max_position_embeddings
        fits = self.blocks.capacity * sizes.block_size
        if limit > fits:
            log.warning("max_model_len %d exceeds the %d tokens the KV pool holds; capping it", limit, fits)
            limit = fits
        self.max_model_len = limit
        self.config = replace(config, max_model_len=limit)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=min(config.max_num_seqs, self.slots.capacity),
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=limit,
            ),
            self.blocks,
            self.slots,
            self.prefix_cache,
        )
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._prompts: dict[str, str | None] = {}
        self.async_scheduling = overlaps_passes(self.executor, config.async_scheduling)
        self._in_flight: tuple[PassPlan, object] | None = None  # the launched pass not yet applied
        # with config.time_passes on a GPU: (device busy s, device idle before it s) of recent passes
        self.pass_device_times: deque[tuple[float, float]] = deque(maxlen=4096)
        log.info(
            "engine ready: %d KV tokens (%d pages of %d), %d sequences, max_model_len %d, async scheduling %s",
            sizes.num_blocks * sizes.block_size,
            sizes.num_blocks,
            sizes.block_size,
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
        self, req_id: str, prompt: str | list[int], params: SamplingParams, cache_salt: str | None = None
    ) -> Request:
        """Validate and build a request (raises ValueError naming the bad field); queues nothing.
        cache_salt: requests share prefix-cache entries only with requests of the same salt."""
        params.validate(self.model_config.vocab_size)
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            ids = self.tokenize(prompt)
        else:
            ids = list(prompt)
        if not ids:
            raise ValueError("prompt: must not be empty")
        vocab = self.model_config.vocab_size
        for t in ids:
            if not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"prompt_token_ids: token id {t!r} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(ids)} tokens leave no room to generate within max_model_len={self.max_model_len}"
            )
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError("cache_salt: must be a string")
        if cache_salt is not None and len(cache_salt) > 256:
            raise ValueError("cache_salt: at most 256 characters")
        req = Request(req_id, ids, params, eos_token_ids=self.model_config.eos_token_ids)
        req.cache_key = "salt:" + cache_salt if cache_salt else ""
        return req

    def add_request(
        self, req_id: str, prompt: str | list[int], params: SamplingParams, cache_salt: str | None = None
    ) -> Request:
        req = self.make_request(req_id, prompt, params, cache_salt)
        self.scheduler.add(req)
        self._prompts[req_id] = prompt if isinstance(prompt, str) else None
        if self.tokenizer is not None:
            self._detok[req_id] = IncrementalDetokenizer(
                self.tokenizer,
                req.prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
        return req

    def abort(self, req_id: str) -> RequestOutput | None:
        req = self.scheduler.abort(req_id)
        return None if req is None else self._output(req, [], "")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None

    # ---- one pass ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one pass: synchronously, or (async scheduling) launch the next pass and then apply the
        one launched by the previous step."""
        if self.async_scheduling:
            return self._step_async()
        plan = self.scheduler.schedule()
        outputs = [self._output(req, [], self._flush(req)) for req in self.scheduler.pop_failed()]
        if plan is None:
            return outputs
        try:
            result = self.executor.execute(plan)
        except WorkerFailure as e:
            return outputs + self._on_worker_failure(e)
        return outputs + self._apply(plan, result)

    def _step_async(self) -> list[RequestOutput]:
        # plan and launch pass N+1 while pass N (launched by the previous step) still runs
        plan = self.scheduler.schedule()
        outputs = [self._output(req, [], self._flush(req)) for req in self.scheduler.pop_failed()]
        launched = None
        if plan is not None:
            try:
                launched = self.executor.execute_async(plan)
            except WorkerFailure as e:
                return outputs + self._on_worker_failure(e)
        previous, self._in_flight = self._in_flight, (plan, launched) if plan is not None else None
        if previous is not None:
            # then wait for pass N's tokens and turn them into outputs while pass N+1 runs
            prev_plan, prev_launched = previous
            try:
                result = prev_launched.result()
            except WorkerFailure as e:
                return outputs + self._on_worker_failure(e)
            outputs += self._apply(prev_plan, result)
        return outputs

    def set_async_scheduling(self, enabled: bool) -> list[RequestOutput]:
        """Switch between overlapped and synchronous passes (benchmarks compare the two); the pass in
        flight, if any, is finished first and its outputs returned."""
        outputs: list[RequestOutput] = []
        if self._in_flight is not None:
            (plan, launched), self._in_flight = self._in_flight, None
            try:
                outputs = self._apply(plan, launched.result())
            except WorkerFailure as e:
                outputs = self._on_worker_failure(e)
        self.async_scheduling = enabled and overlaps_passes(self.executor)
        return outputs

    def _apply(self, plan: PassPlan, result: RunnerOutput) -> list[RequestOutput]:
        if result.device_gap_s >= 0:
            self.pass_device_times.append((result.device_busy_s, result.device_gap_s))
        outputs = []
        for req in self.scheduler.apply_output(plan, result):
            out = self._on_token(req)
            if out is not None:
                outputs.append(out)
        return outputs

    def _on_worker_failure(self, e: WorkerFailure) -> list[RequestOutput]:
        log.error("%s; failing %d requests and restarting the workers", e, len(self.scheduler.requests))
        outputs = self.fail_all(str(e))
        self.executor.restart()
        # a restarted group may use another transport (no overlap over a compiled graph)
        self.async_scheduling = self.async_scheduling and overlaps_passes(self.executor)
        return outputs

    def fail_all(self, error: str) -> list[RequestOutput]:
        """End every queued and running request with an error (a worker died); the passes in flight
        are dropped."""
        self._in_flight = None
        self.scheduler.forget_in_flight()
        outputs = []
        for req in list(self.scheduler.running) + list(self.scheduler.waiting):
            self.scheduler.finish(req, FinishReason.ERROR, error)
            outputs.append(self._output(req, [], self._flush(req)))
        return outputs

    def _on_token(self, req: Request) -> RequestOutput | None:
        token = req.output_token_ids[-1]
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        delta = ""
        detok = self._detok.get(req.req_id)
        if detok is not None:
            delta = detok.add([token])
            if detok.stopped_by is not None and not req.is_finished:
                req.stop_reason = detok.stopped_by
                self.scheduler.finish(req, FinishReason.STOP)
        if req.is_finished:
            delta += self._flush(req)
        elif self.output_mode == "final":
            return None
        return self._output(req, [token], delta)

    def _flush(self, req: Request) -> str:
        detok = self._detok.get(req.req_id)
        return "" if detok is None else detok.flush()

    def _output(self, req: Request, new_ids: list[int], delta: str) -> RequestOutput:
        """The request's output; lists are the request's own (it is not mutated once finished)."""
        finished = req.is_finished
        params = req.sampling_params
        want_logprobs = params.logprobs is not None
        if finished or self.output_mode == "cumulative":
            detok = self._detok.get(req.req_id)
            completion = CompletionOutput(
                index=0,
                text=detok.text[: detok.emitted] if detok is not None else "",
                token_ids=req.output_token_ids,
                logprobs=req.logprobs if want_logprobs else None,
                finish_reason=req.finish_reason.value if finished else None,
                stop_reason=req.stop_reason,
            )
            prompt_logprobs = req.prompt_logprobs if params.prompt_logprobs is not None else None
        else:
            completion = CompletionOutput(index=0, text="", token_ids=[], logprobs=None, finish_reason=None)
            prompt_logprobs = None
        out = RequestOutput(
            request_id=req.req_id,
            prompt=self._prompts.get(req.req_id),
            prompt_token_ids=req.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=[completion],
            finished=finished,
            delta_text=delta,
            delta_token_ids=new_ids,
            delta_logprobs=req.logprobs[len(req.logprobs) - len(new_ids) :] if want_logprobs and new_ids else [],
            time_to_first_token_s=None if req.first_token_time is None else req.first_token_time - req.arrival_time,
            error=req.error,
            num_cached_tokens=req.num_cached_tokens or 0,
        )
        if finished:
            self._detok.pop(req.req_id, None)
            self._prompts.pop(req.req_id, None)
        return out

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
