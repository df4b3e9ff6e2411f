"""The engine loop and the driver actor.

`EngineLoop` runs an EngineCore on a thread of its own: `submit` validates a request at once (so a
bad field is reported before anything is queued) and hands it to the loop through an inbox; the
loop steps while there is work and passes every RequestOutput to a sink. `Driver` is the Ray actor
that hosts an EngineLoop for the front doors (one per data-parallel replica): it buffers outputs,
which the front doors' engine long-polls in batches (one actor call per batch, not per token), with
the prefix cache's changes when a prefix-aware router mirrors them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from deltaserve.cluster.config import EngineConfig
from deltaserve.cluster.core.engine import EngineCore, ModelInfo
from deltaserve.cluster.core.lora import LoRARequest
from deltaserve.cluster.core.request import NO_OPTIONS, Request, RequestOptions, RequestOutput
from deltaserve.cluster.core.sampling_params import SamplingParams
from deltaserve.workers.config import short

from .startup import build_engine, one_line

log = logging.getLogger(__name__)

# a step slower than this is logged with what it ran (a kernel compiled on first use stalls every
# running request for seconds; the log line shows when and on which batch)
SLOW_STEP_S = 1.0


class QueueFullError(RuntimeError):
    """The waiting queue is at `max_waiting_requests`."""


class EngineUnavailableError(RuntimeError):
    """The engine is stopped, starting or failed."""


class AdapterNotFoundError(LookupError):
    """A request or call names an adapter that is not loaded (gRPC NOT_FOUND)."""


@dataclass(frozen=True)
class AddRequest:
    """Inbox message: a request that `submit` validated, to add to the scheduler."""

    req_id: str
    prompt: str | list[int]
    params: SamplingParams
    lora_request: LoRARequest | None = None
    priority: int = 0
    cache_salt: str | None = None
    # the request `submit` made (its prompt tokenized and checked on the caller's thread): the loop
    # does not tokenize the prompt again (tens of ms for a long text prompt, every running request waiting)
    tokenized: Request | None = None


@dataclass(frozen=True)
class AdapterCall:
    """Inbox message: load or unload an adapter on the loop's thread (the scheduler's slots are
    the loop's), the result or error into `future`."""

    call: Callable[[], object]
    future: Future


@dataclass(frozen=True)
class AbortRequest:
    """Inbox message: abort this request (a no-op once it finished)."""

    req_id: str


class EngineLoop:
    def __init__(self, config: EngineConfig, sink: Callable[[RequestOutput], None], engine: EngineCore | None = None):
        self.config = config
        self.engine = engine or build_engine(config, output_mode="delta")
        self._user_sink = sink
        self._live: set[str] = set()  # submitted and not finished: ids in use
        self._inbox: queue.SimpleQueue[AddRequest | AbortRequest] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._pending = 0  # submitted but not yet added to the scheduler
        self._lock = threading.Lock()
        self.failure: str | None = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # ---- called from other threads -----------------------------------------------------------
    def submit(
        self, req_id: str, prompt: str | list[int], params: SamplingParams, options: RequestOptions = NO_OPTIONS
    ) -> int:
        """Validate and queue a request; returns its prompt length. Raises ValueError naming a bad
        field, AdapterNotFoundError for an adapter not loaded, QueueFullError when the waiting queue is
        full, EngineUnavailableError when stopped."""
        if self._stop.is_set() or self.failure is not None:
            raise EngineUnavailableError(self.failure or "the engine is shutting down")
        lora = self.lora_request(options.lora_name) if options.lora_name else None
        req = self.engine.make_request(req_id, prompt, params, options.cache_salt, lora, options.priority)
        with self._lock:
            if req_id in self._live:
                raise ValueError(f"request_id: {short(req_id, 80)} is already in use")
            limit = self.config.serving.max_waiting_requests
            if self.engine.scheduler.num_waiting + self._pending >= limit:
                raise QueueFullError(f"the waiting queue is full ({limit} requests)")
            self._pending += 1
            self._live.add(req_id)
        self._inbox.put(AddRequest(req_id, prompt, params, lora, options.priority, options.cache_salt, req))
        self._wake.set()
        return req.num_prompt_tokens

    # ---- adapters (any thread) -----------------------------------------------------------------
    def lora_request(self, name: str) -> LoRARequest:
        """The loaded adapter of this name (what the HTTP `model` field and gRPC `lora_name` select)."""
        lora = self.engine.lora_request(name)
        if lora is None:
            raise AdapterNotFoundError(f"lora_name: no adapter named {name[:80]!r} is loaded")
        return lora

    def load_lora(self, name: str, path: str, lora_int_id: int | None = None, timeout: float = 120.0) -> LoRARequest:
        """Load an adapter under `name` (id `lora_int_id`, else a new one: replicas load an adapter under
        one id); ValueError naming the file and field when it cannot be served. Runs on the loop's
        thread between passes."""

        def call() -> LoRARequest:
            if self.engine.lora_request(name) is not None:
                raise ValueError(f"lora_name: {name[:80]!r} is already loaded")
            new_id = 1 + max((r.lora_int_id for r in self.engine.list_loras()), default=0)
            lora = LoRARequest(name, new_id if lora_int_id is None else lora_int_id, path)
            self.engine.add_lora(lora)
            return lora

        return self._adapter_call(call, timeout)

    def unload_lora(self, name: str, timeout: float = 120.0) -> None:
        """Unload an adapter; requests running on it finish on it."""
        lora = self.lora_request(name)
        self._adapter_call(lambda: self.engine.remove_lora(lora.lora_int_id), timeout)

    def list_loras(self) -> list[LoRARequest]:
        return self.engine.list_loras()

    def _adapter_call(self, call: Callable[[], object], timeout: float):
        if self._stop.is_set() or self.failure is not None:
            raise EngineUnavailableError(self.failure or "the engine is shutting down")
        future: Future = Future()
        self._inbox.put(AdapterCall(call, future))
        self._wake.set()
        return future.result(timeout)

    def abort(self, req_id: str) -> None:
        self._inbox.put(AbortRequest(req_id))
        self._wake.set()

    def sink(self, out: RequestOutput) -> None:
        if out.finished:
            with self._lock:
                self._live.discard(out.request_id)
        self._user_sink(out)

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        self.engine.shutdown()

    def stats(self) -> dict:
        sched = self.engine.scheduler
        return {
            "running": len(sched.running),
            "waiting": sched.num_waiting + self._pending,
            "free_pages": self.engine.blocks.num_free,
            "total_pages": self.engine.blocks.capacity,
            "free_slots": self.engine.slots.num_free,
            "total_slots": self.engine.slots.capacity,
            "preemptions": sched.stats.num_preemptions,
            "passes": sched.stats.num_passes,
            "prefix_cache": self.engine.prefix_cache_stats(),
            "spec_decode": self.engine.speculative_stats(),
        }

    # ---- the loop --------------------------------------------------------------------------------
    def _drain_inbox(self) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(message, AddRequest):
                with self._lock:
                    self._pending -= 1
                try:
                    self.engine.add_request(
                        message.req_id,
                        message.prompt,
                        message.params,
                        message.cache_salt,
                        message.lora_request,
                        message.priority,
                        message.tokenized,
                    )
                except ValueError as e:  # e.g. a request id reused while the first is running
                    log.warning("rejected %s: %s", message.req_id, e)
                    continue
            elif isinstance(message, AdapterCall):
                try:
                    message.future.set_result(message.call())
                except Exception as e:
                    message.future.set_exception(e)
            else:
                out = self.engine.abort(message.req_id)
                if out is not None:
                    self.sink(out)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain_inbox()
            if not self.engine.has_unfinished():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            started = time.perf_counter()
            try:
                outputs = self.engine.step()
            except Exception as e:  # an engine bug must not hang every client: fail loudly
                log.exception("engine step failed")
                self.failure = f"engine failed: {type(e).__name__}: {e}"
                for out in self.engine.fail_all(self.failure):
                    self.sink(out)
                return
            elapsed = time.perf_counter() - started
            if elapsed > SLOW_STEP_S:
                sched = self.engine.scheduler
                log.warning(
                    "slow engine step: %.2f s (%d running, %d waiting, pass %d)",
                    elapsed,
                    len(sched.running),
                    sched.num_waiting,
                    sched.stats.num_passes,
                )
            for out in outputs:
                self.sink(out)


class EngineStartError(RuntimeError):
    """The engine failed to start inside the driver actor; the message is the cause in one line."""


@dataclass(frozen=True)
class DriverPlace:
    """Where a driver actor runs, and how its plans reach its workers."""

    node_id: str
    node_ip: str
    transport: str


@dataclass(frozen=True)
class DriverPoll:
    """One long-poll's answer: outputs since the last poll, the page index's changes (for a router's
    PrefixMirror; empty unless asked for), and the engine loop's failure (None while it runs)."""

    outputs: list[RequestOutput]
    cache_events: list[tuple[bool, bytes]]
    failure: str | None


class Driver:
    """Ray actor body (created with `ray.remote(max_concurrency=...)` by the serve entry point). A
    failure to start is kept (`start_error`) rather than raised: an actor that dies in its constructor
    makes Ray print its traceback and a stack dump, where the caller wants the cause in one line."""

    def __init__(self, config: EngineConfig):
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._start_error: str | None = None
        try:
            self.loop = EngineLoop(config, self._outbox.put)
        except Exception as e:
            log.debug("engine start failed", exc_info=True)
            self._start_error = one_line(e)
            return
        self.config = self.loop.engine.config
        # the page index's changes, when a prefix-aware router keeps a mirror of it
        mirrored = config.data_parallel.routing == "prefix_aware"
        self._cache_events = self.loop.engine.prefix_events() if mirrored else None

    def start_error(self) -> str | None:
        """None once the engine is up (workers, weights, pools), else why it failed to start."""
        return self._start_error

    def submit(
        self, req_id: str, prompt: str | list[int], params: SamplingParams, options: RequestOptions = NO_OPTIONS
    ) -> int:
        return self.loop.submit(req_id, prompt, params, options)

    def load_lora(self, name: str, path: str, lora_int_id: int | None = None) -> LoRARequest:
        return self.loop.load_lora(name, path, lora_int_id)

    def unload_lora(self, name: str) -> None:
        self.loop.unload_lora(name)

    def list_loras(self) -> list[LoRARequest]:
        return self.loop.list_loras()

    def abort(self, req_id: str) -> None:
        self.loop.abort(req_id)

    def where(self) -> DriverPlace:
        import ray

        context = ray.get_runtime_context()
        return DriverPlace(context.get_node_id(), ray.util.get_node_ip_address(), self.loop.engine.executor.transport)

    def poll(self, timeout_s: float = 0.1) -> DriverPoll:
        """Every output produced since the last poll (waiting up to timeout_s for the first), the page
        index's changes since then, and the loop's failure."""
        outputs = self._outputs(timeout_s)
        events = []
        if self._cache_events is not None:
            for _ in range(len(self._cache_events)):  # appended by the loop thread meanwhile: next poll
                events.append(self._cache_events.popleft())
        return DriverPoll(outputs, events, self.loop.failure)

    def _outputs(self, timeout_s: float) -> list[RequestOutput]:
        out = []
        try:
            out.append(self._outbox.get(timeout=timeout_s))
        except queue.Empty:
            return out
        deadline = time.monotonic() + 0.002  # gather what one pass produced, not one token per call
        while time.monotonic() < deadline or not self._outbox.empty():
            try:
                out.append(self._outbox.get_nowait())
            except queue.Empty:
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.0002)
        return out

    def tokenize(self, text: str) -> list[int]:
        return self.loop.engine.tokenize(text)

    def info(self) -> ModelInfo:
        return self.loop.engine.model_info()

    def stats(self) -> dict:
        return self.loop.stats()

    def healthy(self) -> bool:
        return self.loop.failure is None and self.loop._thread.is_alive()

    def shutdown(self) -> None:
        self.loop.stop()
