"""AsyncEngine: the asyncio face of the engine, behind both front doors (gRPC and HTTP) and for Python.

    engine = await AsyncEngine.local(EngineConfig.from_kwargs(model=path))
    async for out in engine.generate("Hello", SamplingParams(max_tokens=16), "request-1"):
        print(out.outputs[0].text)   # vLLM's AsyncLLM shapes: cumulative unless output_kind says

Two backends with one API: `local` runs an EngineLoop in this process; `ray` talks to a Driver actor
(which owns the EngineLoop and, through the RayExecutor, the worker group), collecting outputs with
one long-poll call per batch. Streams are asyncio queues keyed by request id; a stream whose
consumer goes away aborts its request, which frees its pages and slot on the next loop turn. The
front doors use `submit` + `stream` (deltas); every output passes the server's metrics on the way.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator

from deltaserve.cluster.config import EngineConfig
from deltaserve.cluster.core.engine import ModelInfo
from deltaserve.cluster.core.lora import LoRARequest
from deltaserve.cluster.core.request import CompletionOutput, RequestOutput
from deltaserve.cluster.core.sampling_params import RequestOutputKind, SamplingParams
from deltaserve.workers.config import short

from . import validation
from .chat_template import ChatTemplate
from .driver import AdapterNotFoundError, Driver, EngineLoop, EngineStartError, EngineUnavailableError, QueueFullError
from .metrics import RequestTimer, ServingMetrics

log = logging.getLogger(__name__)

# a healthy driver stops in seconds; one whose Ray cluster died under it never answers
DRIVER_SHUTDOWN_TIMEOUT_S = 15.0

__all__ = ["AdapterNotFoundError", "AsyncEngine", "EngineUnavailableError", "QueueFullError"]


class AsyncEngine:
    def __init__(self, backend: str, config: EngineConfig, *, loop_engine: EngineLoop | None = None, driver=None):
        self.backend = backend
        self.config = config
        self.model_name = served_model_name(config)
        self.chat_template = ChatTemplate.for_model(config.load.model, config.serving.chat_template)
        self.metrics = ServingMetrics(self.model_name)
        self._loop_engine = loop_engine
        self._driver = driver
        self._streams: dict[str, asyncio.Queue] = {}
        self._timers: dict[str, RequestTimer] = {}
        self._aio = asyncio.get_running_loop()
        self._poller: asyncio.Task | None = None
        self._closing = False
        self.failure: str | None = None
        if backend == "ray":
            self._poller = asyncio.create_task(self._poll_driver())

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    async def local(cls, config: EngineConfig) -> AsyncEngine:
        """The engine in this process (a thread runs its loop)."""
        engine = cls.__new__(cls)
        aio = asyncio.get_running_loop()
        loop_engine = await asyncio.to_thread(
            EngineLoop, config, lambda out: aio.call_soon_threadsafe(engine._dispatch, out)
        )
        try:
            cls.__init__(engine, "local", config, loop_engine=loop_engine)
        except BaseException:
            await asyncio.to_thread(loop_engine.stop)
            raise
        return engine

    @classmethod
    async def ray(cls, config: EngineConfig, *, name: str | None = None) -> AsyncEngine:
        """A Driver actor on the current Ray cluster (ray.init must have run)."""
        import ray

        options = {"max_concurrency": 64, "num_cpus": 0}
        if name:
            options.update(name=name, get_if_exists=False)
        driver = ray.remote(Driver).options(**options).remote(config)
        error = await driver.start_error.remote()  # waits for the engine (workers, weights, pools) to be up
        if error is not None:
            ray.kill(driver)
            raise EngineStartError(error)
        try:
            return cls("ray", config, driver=driver)
        except BaseException:
            ray.kill(driver)
            raise

    # ---- outputs -------------------------------------------------------------------------------
    def _dispatch(self, out: RequestOutput) -> None:
        q = self._streams.get(out.request_id)
        if q is not None:
            q.put_nowait(out)

    async def _poll_driver(self) -> None:
        from ray.exceptions import RayError

        while not self._closing:
            try:
                outputs = await self._driver.poll.remote(0.1)
            except RayError as e:
                self.failure = f"the driver actor failed: {type(e).__name__}"
                log.error("%s: %s", self.failure, e)
                for q in self._streams.values():
                    q.put_nowait(EngineUnavailableError(self.failure))
                return
            for out in outputs:
                self._dispatch(out)

    # ---- requests ------------------------------------------------------------------------------
    async def submit(
        self, req_id: str, prompt: str | list[int], params: SamplingParams, lora_name: str | None = None
    ) -> int:
        """Queue a request (ValueError / AdapterNotFoundError / QueueFullError / EngineUnavailableError
        before queueing). lora_name: the loaded adapter it runs on (None: the base model)."""
        try:
            self._check_up()
            if req_id in self._streams:  # replacing the queue would cut the live request's stream off
                raise ValueError(f"request_id: {short(req_id, 80)} is already in use")
        except Exception as e:
            self._refused(e)
            raise
        self._streams[req_id] = asyncio.Queue()
        self._timers[req_id] = self.metrics.start()
        try:
            if self.backend == "local":
                return self._loop_engine.submit(req_id, prompt, params, lora_name)
            submitted = asyncio.ensure_future(self._driver.submit.remote(req_id, prompt, params, lora_name))
            try:
                return await asyncio.shield(submitted)
            except asyncio.CancelledError:
                # the caller left, but the driver may still take the request: abort it once it has
                with contextlib.suppress(Exception):
                    await submitted
                    await self.abort(req_id)
                raise
        except BaseException as e:
            self._streams.pop(req_id, None)
            self._timers.pop(req_id, None)
            error = _unwrap(e)
            self._refused(error)
            raise error from None

    def _refused(self, error: BaseException) -> None:
        kind = validation.classify(error)
        if kind is not None:
            self.metrics.refused(kind.value)

    async def stream(self, req_id: str) -> AsyncIterator[RequestOutput]:
        """Outputs of a submitted request until it finishes (each carries what its step added in the
        `delta_*` fields; the last one the whole completion); leaving early aborts it."""
        q = self._streams[req_id]
        timer = self._timers.pop(req_id)
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, Exception):
                    raise item
                self.metrics.on_output(timer, item)
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(req_id, None)
            if not finished:
                self.metrics.on_abandoned(timer)
                await self.abort(req_id)

    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        request_id: str,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """vLLM's AsyncLLM.generate: RequestOutputs until the request finishes, whole so far
        (`output_kind` CUMULATIVE, the default), only what each step added (DELTA) or only the last
        (FINAL_ONLY). Bad input raises ValueError naming the field before anything is queued;
        leaving the loop early (or cancelling the task) aborts the request. `lora_request`: a loaded
        adapter to run on (by its name: AdapterNotFoundError when none of that name is loaded)."""
        lora_name = lora_request.lora_name if lora_request is not None else None
        await self.submit(request_id, prompt, sampling_params, lora_name)
        kind = sampling_params.output_kind
        text, token_ids, logprobs = "", [], []
        async with contextlib.aclosing(self.stream(request_id)) as outputs:
            async for out in outputs:
                if kind is RequestOutputKind.FINAL_ONLY and not out.finished:
                    continue
                if kind is RequestOutputKind.DELTA:
                    yield _with_completion(out, out.delta_text, out.delta_token_ids, out.delta_logprobs)
                elif out.finished:
                    yield out  # a final output carries the whole completion
                else:
                    text += out.delta_text
                    token_ids += out.delta_token_ids
                    logprobs += out.delta_logprobs
                    yield _with_completion(out, text, list(token_ids), list(logprobs))

    def render_chat(
        self,
        messages: list,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> str:
        """A chat's prompt text through the model's chat template (ValueError naming a bad field)."""
        if self.chat_template is None:
            raise ValueError("messages: this model has no chat template (give one with --chat-template)")
        return self.chat_template.render(
            validation.chat_messages(messages),
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            template_kwargs=chat_template_kwargs,
        )

    async def discard(self, req_id: str) -> None:
        """Forget a submitted request whose stream was never read (the client left first): abort it.
        A no-op once its stream has ended."""
        if self._streams.pop(req_id, None) is None:
            return
        timer = self._timers.pop(req_id, None)  # still here only when no stream() took it
        if timer is not None:
            self.metrics.on_abandoned(timer)
        await self.abort(req_id)

    async def abort(self, req_id: str) -> None:
        if self.failure is not None:
            return
        if self.backend == "local":
            self._loop_engine.abort(req_id)
        else:
            await self._driver.abort.remote(req_id)

    # ---- adapters ------------------------------------------------------------------------------
    async def lora_request(self, name: str) -> LoRARequest | None:
        """The loaded adapter of this name, or None (the HTTP `model` field's lookup)."""
        return next((r for r in await self.list_loras() if r.lora_name == name), None)

    async def list_loras(self) -> list[LoRARequest]:
        self._check_up()
        if self.backend == "local":
            return self._loop_engine.list_loras()
        return await self._driver.list_loras.remote()

    async def load_lora(self, name: str, path: str) -> LoRARequest:
        """Load an adapter under `name` (ValueError naming the file and field when it cannot be served)."""
        return await self._adapter_call("load_lora", name, path)

    async def unload_lora(self, name: str) -> None:
        """Unload an adapter (AdapterNotFoundError for a name not loaded)."""
        await self._adapter_call("unload_lora", name)

    async def _adapter_call(self, method: str, *args):
        self._check_up()
        try:
            if self.backend == "local":
                return await asyncio.to_thread(getattr(self._loop_engine, method), *args)
            return await getattr(self._driver, method).remote(*args)
        except BaseException as e:
            raise _unwrap(e) from None

    # ---- queries -------------------------------------------------------------------------------
    async def tokenize(self, text: str) -> list[int]:
        self._check_up()
        if self.backend == "local":
            return self._loop_engine.engine.tokenize(text)
        try:
            return await self._driver.tokenize.remote(text)
        except BaseException as e:
            raise _unwrap(e) from None

    async def info(self) -> ModelInfo:
        self._check_up()
        if self.backend == "local":
            return self._loop_engine.engine.model_info()
        return await self._driver.info.remote()

    async def stats(self) -> dict:
        self._check_up()
        if self.backend == "local":
            return self._loop_engine.stats()
        return await self._driver.stats.remote()

    async def render_metrics(self) -> bytes:
        """The Prometheus exposition: the front doors' metrics and the engine's current stats."""
        try:
            self.metrics.update_engine(await asyncio.wait_for(self.stats(), 5))
        except Exception:  # the engine is down: its gauges are left out, the front doors' stay
            self.metrics.update_engine(None)
        return self.metrics.render()

    async def healthy(self) -> bool:
        if self.failure is not None or self._closing:
            return False
        if self.backend == "local":
            return self._loop_engine.failure is None
        try:
            return await asyncio.wait_for(self._driver.healthy.remote(), 5)
        except Exception:
            return False

    @property
    def failed(self) -> str | None:
        """Why the engine went down (the driver actor died, the engine loop failed), else None."""
        return self.failure or (self._loop_engine.failure if self._loop_engine else None)

    def _check_up(self) -> None:
        if self._closing:
            raise EngineUnavailableError("the engine is shutting down")
        if self.failed:
            raise EngineUnavailableError(self.failed)

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    async def shutdown(self) -> None:
        self._closing = True
        if self._poller is not None:
            self._poller.cancel()
        if self.backend == "local":
            await asyncio.to_thread(self._loop_engine.stop)
        else:
            import ray
            from ray.exceptions import RayError

            try:
                await asyncio.wait_for(self._driver.shutdown.remote(), DRIVER_SHUTDOWN_TIMEOUT_S)
            except RayError as e:  # the driver actor is gone already: nothing of it to stop
                log.info("driver actor already gone at shutdown: %s", type(e).__name__)
            except TimeoutError:  # e.g. a Ctrl-C that reached Ray's own processes: nothing reports the death
                log.warning("the driver actor did not stop within %.0f s; killing it", DRIVER_SHUTDOWN_TIMEOUT_S)
            finally:
                with contextlib.suppress(Exception):
                    ray.kill(self._driver)


def served_model_name(config: EngineConfig) -> str:
    """The model's name in the OpenAI API: --served-model-name, else the --model argument."""
    return config.serving.served_model_name or config.load.model or "default"


def _with_completion(out: RequestOutput, text: str, token_ids: list[int], logprobs: list) -> RequestOutput:
    """`out` with outputs[0] holding this text, these ids and logprobs (when the request asked)."""
    done = out.outputs[0]
    asked = done.logprobs is not None or bool(logprobs)
    completion = CompletionOutput(
        index=0,
        text=text,
        token_ids=token_ids,
        cumulative_logprob=sum(next(iter(e.values())).logprob for e in logprobs) if asked else None,
        logprobs=logprobs if asked else None,
        finish_reason=done.finish_reason,
        stop_reason=done.stop_reason,
    )
    return dataclasses.replace(out, outputs=[completion])


def _unwrap(e: BaseException) -> BaseException:
    """A Ray task error carries the driver's exception as its cause: surface that one."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, ValueError | QueueFullError | EngineUnavailableError | AdapterNotFoundError):
        return cause
    return e
