"""AsyncEngine: the asyncio face of the engine that the gateway uses.

Two backends with one API: `local` runs an EngineLoop in this process; `ray` talks to a Driver actor
(which owns the EngineLoop and, through the RayExecutor, the worker group), collecting outputs with
one long-poll call per batch. Streams are asyncio queues keyed by request id; a stream whose
consumer goes away aborts its request, which frees its pages and slot on the next loop turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from deltaserve.cluster.config import EngineConfig
from deltaserve.cluster.core.engine import ModelInfo
from deltaserve.cluster.core.lora import LoRARequest
from deltaserve.cluster.core.request import RequestOutput
from deltaserve.cluster.core.sampling_params import SamplingParams
from deltaserve.workers.config import short

from .driver import AdapterNotFoundError, Driver, EngineLoop, EngineStartError, EngineUnavailableError, QueueFullError

log = logging.getLogger(__name__)

__all__ = ["AdapterNotFoundError", "AsyncEngine", "EngineUnavailableError", "QueueFullError"]


class AsyncEngine:
    def __init__(self, backend: str, *, loop_engine: EngineLoop | None = None, driver=None):
        self.backend = backend
        self._loop_engine = loop_engine
        self._driver = driver
        self._streams: dict[str, asyncio.Queue] = {}
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
        cls.__init__(engine, "local", loop_engine=loop_engine)
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
        return cls("ray", driver=driver)

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
        self._check_up()
        if req_id in self._streams:  # replacing the queue would cut the live request's stream off
            raise ValueError(f"request_id: {short(req_id, 80)} is already in use")
        self._streams[req_id] = asyncio.Queue()
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
            raise _unwrap(e) from None

    async def stream(self, req_id: str) -> AsyncIterator[RequestOutput]:
        """Outputs of a submitted request until it finishes; leaving early aborts it."""
        q = self._streams[req_id]
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(req_id, None)
            if not finished:
                await self.abort(req_id)

    async def generate(
        self, req_id: str, prompt: str | list[int], params: SamplingParams, lora_name: str | None = None
    ):
        await self.submit(req_id, prompt, params, lora_name)
        async for out in self.stream(req_id):
            yield out

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
                await self._driver.shutdown.remote()
            except RayError as e:  # the driver actor is gone already: nothing of it to stop
                log.info("driver actor already gone at shutdown: %s", type(e).__name__)
            finally:
                with contextlib.suppress(Exception):
                    ray.kill(self._driver)


def _unwrap(e: BaseException) -> BaseException:
    """A Ray task error carries the driver's exception as its cause: surface that one."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, ValueError | QueueFullError | EngineUnavailableError | AdapterNotFoundError):
        return cause
    return e
