"""AsyncEngine: the asyncio face of the engine, behind every front door (gRPC gateway, HTTP server) and
for Python.

    engine = await AsyncEngine.local(EngineConfig.from_kwargs(model=path))
    async for out in engine.generate("Hello", SamplingParams(max_tokens=16), "request-1"):
        print(out.outputs[0].text)   # vLLM's AsyncLLM shapes: cumulative unless output_kind says

Behind it are one or more engine replicas (`replicas.py`) and a router (`router.py`): `local` runs one
EngineLoop in this process; `ray` runs `data_parallel_size` Driver actors, each with its worker group
on one node, spread over the Ray cluster, collecting outputs with one long-poll call per batch. Each
request goes to the replica the router picks (least loaded, or prefix-aware) among those answering; a
replica that cannot take the call passes the request to another. Streams are asyncio queues keyed by
request id; a stream whose consumer goes away aborts its request, which frees its pages and slot on
the next loop turn. When a replica goes down its requests in flight end with EngineUnavailableError
(UNAVAILABLE) and the others keep serving while it is placed again. The front doors use `submit` +
`stream` (deltas); every output passes the server's metrics on the way.

LoRA adapters live in each replica's engine: a load or unload goes to every replica (a load that one
replica refuses is undone on the others), a replica placed again loads the adapters the others hold,
and a request naming an adapter goes only to a replica that holds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
from collections.abc import AsyncIterator
from pathlib import Path

from deltaserve.cluster.config import EngineConfig
from deltaserve.cluster.core.engine import ModelInfo, ReplicaInfo
from deltaserve.cluster.core.lora import LoRARequest
from deltaserve.cluster.core.prefix_cache import cache_key_of
from deltaserve.cluster.core.request import NO_OPTIONS, CompletionOutput, RequestOptions, RequestOutput
from deltaserve.cluster.core.sampling_params import RequestOutputKind, SamplingParams
from deltaserve.cluster.core.speculative import SpeculativeInfo
from deltaserve.workers.config import short

from . import validation
from .chat_template import ChatTemplate
from .driver import AdapterNotFoundError, EngineUnavailableError, QueueFullError
from .metrics import RequestTimer, ServingMetrics
from .replicas import LocalReplica, RayReplicas, Replica, ReplicaUnreachable
from .router import make_router
from .startup import sampling_defaults

log = logging.getLogger(__name__)

__all__ = ["AdapterNotFoundError", "AsyncEngine", "EngineUnavailableError", "QueueFullError"]

SERVING = ("up", "suspect")


class AsyncEngine:
    def __init__(self, backend: str, config: EngineConfig):
        self.backend = backend
        self.config = config
        self.model_name = served_model_name(config)
        self.chat_template = ChatTemplate.for_model(config.load.model, config.serving.chat_template)
        # what requests over HTTP and gRPC that leave them unset sample with (generation_config)
        self.default_sampling = sampling_defaults(config)
        if self.default_sampling:
            log.info("sampling defaults from the model's generation config: %s", self.default_sampling)
        self.metrics = ServingMetrics(self.model_name)
        self._timers: dict[str, RequestTimer] = {}
        self._replicas: list[Replica] = []
        self._ray: RayReplicas | None = None
        self._router = None
        self._streams: dict[str, asyncio.Queue] = {}
        self._owner: dict[str, Replica] = {}  # request id -> the replica running it
        self._submitting: set[str] = set()  # handed to a replica that has not answered yet
        # the model's tokenizer here (the router's text prompts, decode for the front doors), loaded on a
        # thread while the engine starts: a 250k-entry tokenizer.json takes seconds, which on the event
        # loop would hold every stream and the replicas' health polls
        self._tokenizer = None
        self._tokenizer_lock = threading.Lock()
        self._adapters: dict[str, LoRARequest] = {}  # loaded adapters by name, each with one id on every replica
        self._adapter_lock = asyncio.Lock()  # loads, unloads and a new replica's catch-up run one at a time
        self._last_failure: str | None = None  # the last replica that went down, and why
        self._closing = False

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    async def local(cls, config: EngineConfig) -> AsyncEngine:
        """The engine in this process (a thread runs its loop)."""
        if config.data_parallel.data_parallel_size > 1:
            raise ValueError("data_parallel_size: the local backend runs one engine in this process; replicas need Ray")
        engine = cls("local", config)
        tokenizer = asyncio.ensure_future(asyncio.to_thread(engine._local_tokenizer))
        try:
            replica = await LocalReplica.start(config, engine._dispatch)
        finally:
            await _settled(tokenizer)
        engine._replicas = [replica]
        engine._router = make_router(config.data_parallel.routing, (await replica.model_info()).block_size)
        return engine

    @classmethod
    async def ray(cls, config: EngineConfig, *, name: str | None = None) -> AsyncEngine:
        """`data_parallel_size` Driver actors on the current Ray cluster (ray.init must have run), each
        with its workers on one node; raises EngineStartError (the cause in one line) if one fails."""
        engine = cls("ray", config)
        tokenizer = asyncio.ensure_future(asyncio.to_thread(engine._local_tokenizer))
        engine._ray = RayReplicas(config, engine._dispatch, engine._replica_down, name, on_ready=engine._catch_up)
        try:
            await engine._ray.start()
        finally:
            await _settled(tokenizer)
        engine._replicas = engine._ray.slots
        try:
            block_size = (await engine._replicas[0].model_info()).block_size
        except BaseException:
            await engine._ray.shutdown()
            raise
        engine._router = make_router(config.data_parallel.routing, block_size)
        return engine

    # ---- outputs -------------------------------------------------------------------------------
    def _dispatch(self, replica: Replica, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if self._owner.get(out.request_id) is not replica:
                continue  # aborted, or its replica was declared down meanwhile
            if out.finished:
                self._release(out.request_id)
            q = self._streams.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    def _release(self, req_id: str) -> None:
        replica = self._owner.pop(req_id, None)
        if replica is not None:
            replica.in_flight -= 1

    def _replica_down(self, replica: Replica, reason: str) -> None:
        """Its requests in flight end UNAVAILABLE; it is placed again (on a node with room)."""
        error = EngineUnavailableError(f"{replica.where()} failed: {reason}")
        self._last_failure = str(error)
        # a request still being handed over is not lost: its submit fails over to another replica
        lost = [req_id for req_id, owner in self._owner.items() if owner is replica and req_id not in self._submitting]
        for req_id in lost:
            self._release(req_id)
            q = self._streams.get(req_id)
            if q is not None:
                q.put_nowait(error)
        if lost:
            log.error("%d request(s) in flight on %s end UNAVAILABLE", len(lost), replica.where())
        if self._ray is not None and not self._closing:
            self._ray.replace(replica)

    # ---- requests ------------------------------------------------------------------------------
    async def submit(
        self, req_id: str, prompt: str | list[int], params: SamplingParams, options: RequestOptions = NO_OPTIONS
    ) -> int:
        """Queue a request on the replica the router picks (ValueError / AdapterNotFoundError /
        QueueFullError / EngineUnavailableError before queueing). options: the loaded adapter it runs
        on (None: the base model), its priority and prefix-cache salt."""
        try:
            self._check_up()
            options.check()
            if req_id in self._streams:  # replacing the queue would cut the live request's stream off
                raise ValueError(f"request_id: {short(req_id, 80)} is already in use")
        except Exception as e:
            self._refused(e)
            raise
        self._streams[req_id] = asyncio.Queue()
        self._timers[req_id] = self.metrics.start()
        tried: set[int] = set()
        try:
            ids = None  # the prefix-aware router's ids of a text prompt, tokenized off the event loop
            if isinstance(prompt, str) and self._router.needs_token_ids and options.lora_name is None:
                ids = await asyncio.to_thread(self._token_ids, prompt)
            while True:
                replica = self._route(prompt, tried, options, ids)
                # owned before the call: its first outputs may come back before the call returns
                self._owner[req_id] = replica
                replica.in_flight += 1
                self._submitting.add(req_id)
                try:
                    num_prompt_tokens = await replica.submit(req_id, prompt, params, options)
                except ReplicaUnreachable as e:
                    self._release(req_id)
                    tried.add(replica.index)
                    replica.suspect(str(e))
                    continue
                except BaseException:
                    self._release(req_id)
                    raise
                finally:
                    self._submitting.discard(req_id)
                if replica.state not in SERVING:  # taken, then its replica went down: lost with it
                    self._release(req_id)
                    raise EngineUnavailableError(f"{replica.where()} failed: {replica.failure}")
                replica.routed += 1
                return num_prompt_tokens
        except BaseException as e:
            self._streams.pop(req_id, None)
            self._timers.pop(req_id, None)
            self._refused(e)
            raise

    def _refused(self, error: BaseException) -> None:
        kind = validation.classify(error)
        if kind is not None:
            self.metrics.refused(kind.value)

    def _route(
        self, prompt: str | list[int], tried: set[int], options: RequestOptions, ids: list[int] | None = None
    ) -> Replica:
        """The replica for a request: among those answering (suspect ones only when no other is) that
        hold its adapter. ids: a text prompt's, when the router reads them (tokenized by the caller)."""
        lora_name = options.lora_name
        lacking = False
        for states in (("up",), ("suspect",)):
            candidates = [r for r in self._replicas if r.state in states and r.index not in tried]
            if lora_name is not None:
                holding = [r for r in candidates if lora_name in r.adapters]
                lacking |= len(holding) < len(candidates)
                candidates = holding
            if candidates:
                # a request on an adapter has block hashes of a key per engine, which no mirror can follow
                routed = self._router.needs_token_ids and lora_name is None
                if routed and ids is None:
                    ids = self._token_ids(prompt)
                return candidates[self._router.choose(candidates, ids, cache_key_of(None, options.cache_salt))]
        if lacking:
            raise AdapterNotFoundError(f"lora_name: no adapter named {short(lora_name, 80)} is loaded")
        raise EngineUnavailableError(self._why_down())

    def _token_ids(self, prompt: str | list[int]) -> list[int] | None:
        if not isinstance(prompt, str):
            return list(prompt) if isinstance(prompt, list | tuple) else None
        tokenizer = self._local_tokenizer()
        return None if tokenizer is None else tokenizer.encode(prompt)

    def _local_tokenizer(self):
        """The model's tokenizer in this process (None without tokenizer.json); loaded by the engine's start,
        on a thread."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                from deltaserve.cluster.core.tokenizer import Tokenizer

                model = self.config.load.model
                if model is None or not (Path(model) / "tokenizer.json").is_file():
                    return None
                self._tokenizer = Tokenizer(model)
            return self._tokenizer

    def decode(self, token_ids: list[int]) -> str:
        """The text of these tokens (special ones kept; "" without a tokenizer)."""
        tokenizer = self._local_tokenizer()
        return "" if tokenizer is None else tokenizer.decode(token_ids, skip_special_tokens=False)

    def token_texts(self, token_ids: list[int]) -> list[str]:
        """Each token's text (as the detokenizer writes a lone token; "" without a tokenizer): what
        an echoed prompt shows."""
        tokenizer = self._local_tokenizer()
        return [""] * len(token_ids) if tokenizer is None else tokenizer.decode_each(token_ids)

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
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """vLLM's AsyncLLM.generate: RequestOutputs until the request finishes, whole so far
        (`output_kind` CUMULATIVE, the default), only what each step added (DELTA) or only the last
        (FINAL_ONLY). n > 1: each output before the last holds the completion that changed (its
        `index`), the last one every completion. Bad input raises ValueError naming the field before
        anything is queued; leaving the loop early (or cancelling the task) aborts the request. `lora_request`: a loaded
        adapter to run on (by its name: AdapterNotFoundError when none of that name is loaded); `priority`: lower
        first (scheduling_policy="priority"); `cache_salt`: shares the prefix cache only with the same salt."""
        lora_name = lora_request.lora_name if lora_request is not None else None
        await self.submit(request_id, prompt, sampling_params, RequestOptions(lora_name, priority, cache_salt))
        kind = sampling_params.output_kind
        texts: dict[int, str] = {}  # each completion's text, ids and logprobs so far
        ids: dict[int, list[int]] = {}
        lps: dict[int, list] = {}
        prompt_lps = None  # the prompt's logprobs come with the first tokens: cumulative outputs keep them
        async with contextlib.aclosing(self.stream(request_id)) as outputs:
            async for out in outputs:
                if kind is RequestOutputKind.FINAL_ONLY and not out.finished:
                    continue
                if kind is RequestOutputKind.DELTA:
                    yield _with_completion(out, out.delta_text, out.delta_token_ids, out.delta_logprobs)
                elif out.finished:
                    yield out  # a final output carries every completion whole
                else:
                    i = out.delta_index
                    texts[i] = texts.get(i, "") + out.delta_text
                    ids.setdefault(i, []).extend(out.delta_token_ids)
                    lps.setdefault(i, []).extend(out.delta_logprobs)
                    prompt_lps = out.prompt_logprobs or prompt_lps
                    whole = _with_completion(out, texts[i], list(ids[i]), list(lps[i]))
                    yield dataclasses.replace(whole, prompt_logprobs=prompt_lps)

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
        replica = self._owner.get(req_id)
        if replica is None:
            return
        self._release(req_id)
        if replica.state in SERVING:
            await replica.abort(req_id)

    # ---- adapters ------------------------------------------------------------------------------
    async def lora_request(self, name: str) -> LoRARequest | None:
        """The loaded adapter of this name, or None (the HTTP `model` field's lookup)."""
        self._check_up()
        return self._adapters.get(name)

    async def list_loras(self) -> list[LoRARequest]:
        self._check_up()
        return list(self._adapters.values())

    async def load_lora(self, name: str, path: str) -> LoRARequest:
        """Load an adapter under `name` on every serving replica, with one id (ValueError naming the file
        and field when it cannot be served; a replica that refuses it has it unloaded from the others)."""
        self._check_up()
        async with self._adapter_lock:
            if name in self._adapters:
                raise ValueError(f"lora_name: {short(name, 80)} is already loaded")
            lora_int_id = 1 + max((r.lora_int_id for r in self._adapters.values()), default=0)
            replicas = [r for r in self._replicas if r.state in SERVING]
            results = await asyncio.gather(
                *(r.load_lora(name, path, lora_int_id) for r in replicas), return_exceptions=True
            )
            loaded = [(r, lora) for r, lora in zip(replicas, results, strict=True) if isinstance(lora, LoRARequest)]
            refused = [(r, e) for r, e in zip(replicas, results, strict=True) if not isinstance(e, LoRARequest)]
            for replica, error in refused:
                if isinstance(error, ReplicaUnreachable):  # it missed the load: no requests on it for this adapter
                    replica.suspect(str(error))
                    continue
                if loaded:  # refused by this one only (e.g. the file is missing on its node): undone everywhere
                    await asyncio.gather(*(r.unload_lora(name) for r, _ in loaded), return_exceptions=True)
                    if isinstance(error, ValueError):
                        raise ValueError(f"{error} (on {replica.where()}; loaded on no replica)") from None
                raise error
            if not loaded:
                raise EngineUnavailableError(self._why_down())
            for replica, _ in loaded:
                replica.adapters.add(name)
            self._adapters[name] = loaded[0][1]
            return loaded[0][1]

    async def unload_lora(self, name: str) -> None:
        """Unload an adapter from every replica (AdapterNotFoundError for a name not loaded); requests
        running on it finish on it."""
        self._check_up()
        async with self._adapter_lock:
            if name not in self._adapters:
                raise AdapterNotFoundError(f"lora_name: no adapter named {short(name, 80)} is loaded")
            del self._adapters[name]
            holding = [r for r in self._replicas if name in r.adapters]
            for replica in holding:
                replica.adapters.discard(name)  # new requests naming it go nowhere from now on
            results = await asyncio.gather(*(r.unload_lora(name) for r in holding), return_exceptions=True)
            for replica, error in zip(holding, results, strict=True):
                if isinstance(error, BaseException) and not isinstance(error, AdapterNotFoundError):
                    log.error("%s could not unload adapter %s: %s", replica.where(), short(name, 80), error)

    async def _catch_up(self, replica: Replica) -> None:
        """Load the adapters the others hold onto a replica placed again, before it takes requests; one
        it cannot load is left out there (requests naming it go to the other replicas)."""
        async with self._adapter_lock:
            for lora in self._adapters.values():
                try:
                    await replica.load_lora(lora.lora_name, lora.path, lora.lora_int_id)
                except Exception as e:
                    log.error("%s could not load adapter %s again: %s", replica.where(), lora.lora_name, e)
                    continue
                replica.adapters.add(lora.lora_name)

    # ---- queries -------------------------------------------------------------------------------
    def _serving(self) -> list[Replica]:
        self._check_up()
        up = [r for r in self._replicas if r.state == "up"]
        return up or [r for r in self._replicas if r.state in SERVING]

    async def tokenize(self, text: str) -> list[int]:
        return await self._serving()[0].tokenize(text)

    async def info(self) -> ModelInfo:
        """The model (from a replica that answers), with every replica's place and load, and the serving
        replicas' speculative decoding counters added up."""
        serving = self._serving()
        infos = [await serving[0].model_info()]
        if infos[0].speculative is not None and len(serving) > 1:
            others = await asyncio.gather(*(r.model_info() for r in serving[1:]), return_exceptions=True)
            infos += [i for i in others if isinstance(i, ModelInfo)]
        speculative = None if infos[0].speculative is None else SpeculativeInfo.total([i.speculative for i in infos])
        return dataclasses.replace(
            infos[0],
            speculative=speculative,
            data_parallel_size=self.config.data_parallel.data_parallel_size,
            replicas=self.replica_infos(),
        )

    def replica_infos(self) -> tuple[ReplicaInfo, ...]:
        return tuple(r.info() for r in self._replicas)

    async def stats(self) -> dict:
        """The serving replicas' counts added up (nested ones too; ratios only per replica), and each
        replica's own under `replicas`."""
        serving = self._serving()
        each = await asyncio.gather(*(r.stats() for r in serving), return_exceptions=True)
        answered = [(r, s) for r, s in zip(serving, each, strict=True) if not isinstance(s, BaseException)]
        total = _added_up([stats for _, stats in answered]) if answered else {}
        total["replicas"] = [{"index": replica.index, **stats} for replica, stats in answered]
        return total

    async def render_metrics(self) -> bytes:
        """The Prometheus exposition: the front doors' metrics and the engine's current stats."""
        try:
            self.metrics.update_engine(await asyncio.wait_for(self.stats(), 5))
        except Exception:  # the engine is down: its gauges are left out, the front doors' stay
            self.metrics.update_engine(None)
        return self.metrics.render()

    async def healthy(self) -> bool:
        return not self._closing and any(r.state in SERVING for r in self._replicas)

    @property
    def failed(self) -> str | None:
        """Why a replica went down last (its driver actor died, its engine loop failed: even one placed
        again since), else None."""
        return self._last_failure or next((r.failure for r in self._replicas if r.failure), None)

    def _check_up(self) -> None:
        if self._closing:
            raise EngineUnavailableError("the engine is shutting down")
        if not any(r.state in SERVING for r in self._replicas):
            raise EngineUnavailableError(self._why_down())

    def _why_down(self) -> str:
        failures = [r.failure for r in self._replicas if r.failure]
        placing = sum(r.state == "placing" for r in self._replicas)
        why = failures[-1] if failures else "no replica is up"
        return why + (f" ({placing} replica(s) being placed again)" if placing else "")

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    async def shutdown(self) -> None:
        self._closing = True
        if self._ray is not None:
            await self._ray.shutdown()
        else:
            await asyncio.gather(*(r.shutdown() for r in self._replicas))


def served_model_name(config: EngineConfig) -> str:
    """The model's name in the OpenAI API: --served-model-name, else the --model argument."""
    return config.serving.served_model_name or config.load.model or "default"


def _with_completion(out: RequestOutput, text: str, token_ids: list[int], logprobs: list) -> RequestOutput:
    """`out` with one output, its completion `delta_index` holding this text, these ids and logprobs
    (when the request asked)."""
    done = out.completion(out.delta_index)
    asked = done.logprobs is not None or bool(logprobs)
    completion = CompletionOutput(
        index=done.index,
        text=text,
        token_ids=token_ids,
        cumulative_logprob=sum(next(iter(e.values())).logprob for e in logprobs) if asked else None,
        logprobs=logprobs if asked else None,
        finish_reason=done.finish_reason,
        stop_reason=done.stop_reason,
    )
    return dataclasses.replace(out, outputs=[completion])


def _added_up(values: list):
    """One stats value from each replica, added up: counts (and per-position lists of counts) summed,
    flags true when any is, dicts key by key, names when all agree; None for what does not add up
    (a ratio, a name that differs), which the total leaves out."""
    first = values[0]
    if isinstance(first, bool):
        return any(values)
    if isinstance(first, int):
        return sum(values) if all(isinstance(v, int) for v in values) else None
    if isinstance(first, list):
        if any(not isinstance(v, list) or len(v) != len(first) for v in values):
            return None
        items = [_added_up(list(column)) for column in zip(*values, strict=True)]
        return None if None in items else items
    if isinstance(first, dict):
        keys = [k for k in first if all(isinstance(v, dict) and k in v for v in values)]
        added = {k: _added_up([v[k] for v in values]) for k in keys}
        return {k: v for k, v in added.items() if v is not None}
    if isinstance(first, str):
        return first if all(v == first for v in values) else None
    return None


async def _settled(task: asyncio.Future) -> None:
    """Wait for a start-up side task (never left running past a failed start); its error, if any, is the
    first use's to raise again (a tokenizer that does not load: the requests that need it fail)."""
    with contextlib.suppress(Exception):
        await task
