r"""Serving benchmark: a load generator against a running `deltaserve serve`, over gRPC or over the
OpenAI-compatible HTTP API (`--backend openai`: streamed /v1/completions), so one tool compares both.

Single node (a server on this machine; random token-id prompts, 64 requests in flight):

    deltaserve serve --port 50051 &
    deltaserve bench serve --target 127.0.0.1:50051 --num-prompts 1000 --input-len 1024 --output-len 128 \
        --max-concurrency 64 --json serve.json

The same load through the HTTP port of the same server (`serve` listens on both):

    deltaserve bench serve --backend openai --target http://127.0.0.1:8000 --num-prompts 1000 --input-len 1024 \
        --output-len 128 --max-concurrency 64

Text prompts sampled from a file, lengths uniform in [0.5, 1.5] x 512 tokens, Poisson arrivals at 20 req/s:

    deltaserve bench serve --dataset-path corpus.txt --input-len 512 --range-ratio 0.5 --request-rate 20

Multi-turn chat with a shared system prompt (prefix caching: 32 conversations of 4 turns, each turn
resending the whole history with 128 new user tokens; the report gives the prefix-cache hit rate):

    deltaserve bench serve --num-prompts 32 --num-turns 4 --shared-prefix-len 2048 --input-len 128 \
        --output-len 128 --max-concurrency 16

Several completions of each prompt (`--n 8`: output tokens count all of them; with prefix caching on the
server the prompt is prefilled once; compare a server started with `--no-enable-prefix-caching`). The
request's hit rate counts its first completion's hit; over gRPC the report's "Server prefix cache" line
gives the server's own counts over the run, the other completions' hits included:

    deltaserve bench serve --target 127.0.0.1:50051 --num-prompts 64 --n 8 --input-len 2048 --output-len 128

Multi-node: 4 client actors on each alive node of the Ray cluster, their records merged into one report
(the entrypoint, and so the JSON file, runs on the head node; deltaserve must be installed on every node):

    ray job submit --address http://HEAD_IP:8265 -- deltaserve bench serve --target SERVER_IP:50051 \
        --clients-per-node 4 --num-prompts 8000 --max-concurrency 512 --request-rate 400 --json /tmp/serve.json

The workload (prompts, lengths, arrival times) is planned once from --seed and dealt round-robin to the
clients, so the union of their schedules is the same at any client count; --max-concurrency is the total
over all clients. Latencies are measured per request on the client with time.perf_counter, from the moment
the request is sent (after any wait for a concurrency slot): TTFT to the first chunk with tokens, ITL as
every gap between chunks, TPOT as (E2E - TTFT) / (completion tokens - 1). Warm-up requests (per client)
are not counted. The exit status is 1 when no request succeeded, 2 on bad settings or an unreachable server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import grpc
import httpx
import numpy as np

from deltaserve.cluster.entrypoints.client import AsyncGenerationClient, Chunk, Final
from deltaserve.cluster.entrypoints.http_client import HttpStatusError, OpenAIHttpClient

# Tokenize RPCs stay far below the gateway's 4 MiB message limit with pieces of this many characters
TOKENIZE_PIECE_CHARS = 64 * 1024
# Ray clients get their start signal this long ahead, so that all of them begin together
RAY_START_DELAY_S = 0.5
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2e")
BACKENDS = ("grpc", "openai")


@dataclass
class BenchSettings:
    """Everything one run needs (plain values: it travels to the Ray client actors)."""

    target: str = "127.0.0.1:50051"  # host:port (gRPC), or the HTTP server's URL (openai)
    backend: str = "grpc"
    num_prompts: int = 1000
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0  # lengths uniform in [len * (1 - r), len * (1 + r)]
    dataset_path: str | None = None  # None: random token ids
    prompt_format: str = "token_ids"  # or "text": dataset windows sent as text, tokenized by the server
    request_rate: float = math.inf  # Poisson arrivals per second; inf sends everything at once
    max_concurrency: int | None = None  # requests in flight over all clients; None: no limit
    num_warmups: int = 2  # per client
    seed: int = 0
    temperature: float = 0.0
    ignore_eos: bool = True
    n: int = 1  # completions of each prompt (SamplingParams.n: the prompt prefilled once)
    request_timeout_s: float | None = None
    clients_per_node: int | None = None  # either of these two runs the clients as Ray actors
    num_client_nodes: int | None = None
    # multi-turn: num_prompts conversations of num_turns turns, each turn resending the history (prompt,
    # replies, input_len new tokens); every request starts with the same shared_prefix_len tokens
    num_turns: int = 1
    shared_prefix_len: int = 0
    # this share of the requests (drawn from the seed) is sent at priority 0, the rest at priority 1 (a
    # server under --scheduling-policy priority serves the first first); 0: every request at 0
    priority_fraction: float = 0.0

    @property
    def uses_ray(self) -> bool:
        return self.clients_per_node is not None or self.num_client_nodes is not None

    def validate(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.num_prompts < 1 or self.input_len < 1 or self.output_len < 1:
            raise ValueError("num_prompts, input_len and output_len must be at least 1")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")
        if self.prompt_format not in ("token_ids", "text"):
            raise ValueError(f"prompt_format must be token_ids or text, got {self.prompt_format!r}")
        if self.prompt_format == "text" and self.dataset_path is None:
            raise ValueError("prompt_format text needs a dataset_path (random prompts are token ids)")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be positive (inf: all at once), got {self.request_rate}")
        if not 1 <= self.n <= 128:
            raise ValueError(f"n must be in [1, 128], got {self.n}")
        if self.n > 1 and self.num_turns > 1:
            raise ValueError("n > 1 and num_turns > 1 do not combine (which completion would the next turn carry?)")
        if self.num_warmups < 0:
            raise ValueError(f"num_warmups must be at least 0, got {self.num_warmups}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, got {self.max_concurrency}")
        for name in ("clients_per_node", "num_client_nodes"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if not 0.0 <= self.priority_fraction < 1.0:
            raise ValueError(f"priority_fraction must be in [0, 1), got {self.priority_fraction}")
        if self.num_turns < 1 or self.shared_prefix_len < 0:
            raise ValueError("num_turns must be at least 1 and shared_prefix_len at least 0")
        if (self.num_turns > 1 or self.shared_prefix_len) and (
            self.prompt_format != "token_ids" or self.dataset_path is not None
        ):
            raise ValueError("num_turns and shared_prefix_len work on random token-id prompts")


@dataclass
class PlannedRequest:
    index: int  # position in the workload, which is in arrival order
    prompt: str | list[int]
    prompt_len: int  # tokens; for text prompts an estimate (the server's count is recorded)
    output_len: int
    arrival_s: float  # when to send it, seconds after the run's start
    # a conversation: the user tokens of its later turns (each turn sends prompt + replies + these)
    follow_ups: list[list[int]] = field(default_factory=list)
    priority: int = 0


@dataclass
class RequestRecord:
    """One measured request: the same from the in-process client and from Ray client actors."""

    index: int
    client: int
    status: str  # "OK", the gRPC status code name, or HTTP_<status>
    error: str
    prompt_tokens: int  # the server's count (the planned one when the request failed)
    max_tokens: int
    completion_tokens: int  # tokens received
    cached_tokens: int
    finish_reason: str | None
    start_s: float  # sent, seconds after the run's common start
    ttft_s: float | None  # None when no token arrived
    e2e_s: float  # until the stream ended (or failed)
    itl_s: list[float] = field(default_factory=list)  # gaps between consecutive chunks
    priority: int = 0

    @property
    def ok(self) -> bool:
        return self.status == "OK"


@dataclass
class BenchResult:
    settings: BenchSettings
    model: str
    num_clients: int
    records: list[RequestRecord]  # sorted by index
    summary: dict
    client_nodes: list[str] = field(default_factory=list)  # Ray clients: each client's node address


# ---- the workload ------------------------------------------------------------------------------------
def sample_lengths(rng: np.random.Generator, length: int, range_ratio: float, count: int) -> list[int]:
    """`count` lengths uniform in [length * (1 - range_ratio), length * (1 + range_ratio)], at least 1."""
    low = max(1, int(length * (1 - range_ratio)))
    high = max(low, int(length * (1 + range_ratio)))
    return rng.integers(low, high + 1, count).tolist()


def arrival_offsets(rng: np.random.Generator, count: int, request_rate: float) -> list[float]:
    """Send times of a Poisson process at `request_rate` (the first at 0); all 0 when the rate is inf."""
    if math.isinf(request_rate):
        return [0.0] * count
    gaps = rng.exponential(1.0 / request_rate, count - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def connect(settings: BenchSettings) -> AsyncGenerationClient | OpenAIHttpClient:
    """A client of the target over the settings' backend (both yield Chunk and Final items)."""
    if settings.backend == "openai":
        target = settings.target if "://" in settings.target else f"http://{settings.target}"
        return OpenAIHttpClient(target)
    return AsyncGenerationClient(settings.target)


def failure(error: BaseException) -> tuple[str, str] | None:
    """(status, detail) of a request that failed over either backend; None for anything else."""
    if isinstance(error, grpc.RpcError):
        return error.code().name, error.details() or ""
    if isinstance(error, HttpStatusError):
        return error.status_name, error.message
    if isinstance(error, httpx.HTTPError):
        return "HTTP_ERROR", f"{type(error).__name__}: {error}"
    return None


async def tokenize_file(client: AsyncGenerationClient | OpenAIHttpClient, text: str) -> np.ndarray:
    """The file's token ids, tokenized by the server piece by piece (pieces end at line ends)."""
    ids: list[int] = []
    piece: list[str] = []
    piece_chars = 0
    for line in text.splitlines(keepends=True):
        piece.append(line)
        piece_chars += len(line)
        if piece_chars >= TOKENIZE_PIECE_CHARS:
            ids += await client.tokenize("".join(piece))
            piece, piece_chars = [], 0
    if piece:
        ids += await client.tokenize("".join(piece))
    return np.asarray(ids, dtype=np.int64)


def _text_window(text: str, start: int, length: int) -> str:
    """`length` characters from `start`, wrapping around (a file shorter than a prompt still serves)."""
    window = text[start : start + length]
    while len(window) < length:
        window += text[: length - len(window)]
    return window


async def plan_workload(
    settings: BenchSettings, client: AsyncGenerationClient | OpenAIHttpClient
) -> tuple[str, list[PlannedRequest]]:
    """(the served model, the requests in arrival order), all drawn from settings.seed."""
    info = await client.model_info()
    # one stream each, so that a seed gives the same lengths and schedule whatever the prompts are
    length_rng, prompt_rng, arrival_rng, priority_rng = (
        np.random.default_rng(s) for s in np.random.SeedSequence(settings.seed).spawn(4)
    )
    n = settings.num_prompts
    input_lens = sample_lengths(length_rng, settings.input_len, settings.range_ratio, n)
    output_lens = sample_lengths(length_rng, settings.output_len, settings.range_ratio, n)
    longest = settings.shared_prefix_len + settings.num_turns * (max(input_lens) + max(output_lens))
    if longest > info.max_model_len:
        raise ValueError(
            f"up to {longest} tokens (shared prefix, {settings.num_turns} turns of {max(input_lens)} prompt + "
            f"{max(output_lens)} output tokens) exceed the server's max_model_len={info.max_model_len}"
        )
    prompts: list[str | list[int]]
    if settings.dataset_path is None:
        prompts = [prompt_rng.integers(0, info.vocab_size, length).tolist() for length in input_lens]
    else:
        with open(settings.dataset_path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        tokens = await tokenize_file(client, text)
        if len(tokens) == 0:
            raise ValueError(f"{settings.dataset_path}: no tokens")
        if settings.prompt_format == "token_ids":
            starts = prompt_rng.integers(0, len(tokens), n)
            prompts = [
                tokens[(start + np.arange(length)) % len(tokens)].tolist()
                for start, length in zip(starts, input_lens, strict=True)
            ]
        else:
            chars_per_token = len(text) / len(tokens)
            starts = prompt_rng.integers(0, len(text), n)
            prompts = [
                _text_window(text, int(start), max(1, round(length * chars_per_token)))
                for start, length in zip(starts, input_lens, strict=True)
            ]
    arrivals = arrival_offsets(arrival_rng, n, settings.request_rate)
    high = priority_rng.random(n)  # below priority_fraction: priority 0
    shared = prompt_rng.integers(0, info.vocab_size, settings.shared_prefix_len).tolist()
    workload = [
        PlannedRequest(
            i,
            shared + prompts[i] if shared else prompts[i],
            settings.shared_prefix_len + input_lens[i],
            output_lens[i],
            arrivals[i],
            [prompt_rng.integers(0, info.vocab_size, input_lens[i]).tolist() for _ in range(settings.num_turns - 1)],
            priority=int(high[i] >= settings.priority_fraction) if settings.priority_fraction else 0,
        )
        for i in range(n)
    ]
    return info.model, workload


def split_concurrency(max_concurrency: int | None, num_clients: int) -> list[int | None]:
    """Each client's share of the total limit (the first ones take the remainder)."""
    if max_concurrency is None:
        return [None] * num_clients
    if max_concurrency < num_clients:
        raise ValueError(f"max_concurrency {max_concurrency} is below the {num_clients} clients")
    share, extra = divmod(max_concurrency, num_clients)
    return [share + (i < extra) for i in range(num_clients)]


# ---- one client ------------------------------------------------------------------------------------------
class LoadClient:
    """Sends one share of the workload from one asyncio loop: in-process, or as a Ray actor per client."""

    def __init__(
        self, settings: BenchSettings, client_id: int, requests: list[PlannedRequest], max_concurrency: int | None
    ):
        self.settings = settings
        self.client_id = client_id
        self.requests = requests
        self.max_concurrency = max_concurrency
        self._client: AsyncGenerationClient | OpenAIHttpClient | None = None

    def _connection(self) -> AsyncGenerationClient | OpenAIHttpClient:
        # made on first use: a gRPC aio channel belongs to the running loop, which a Ray actor's __init__ lacks
        if self._client is None:
            self._client = connect(self.settings)
        return self._client

    async def warmup(self) -> None:
        """Send num_warmups requests of this share one by one (not recorded); raise if one fails."""
        for i in range(self.settings.num_warmups if self.requests else 0):
            request = self.requests[i % len(self.requests)]
            if isinstance(request.prompt, list):  # reversed: warms the kernels, leaves no cached prefix behind
                request = PlannedRequest(
                    request.index, request.prompt[::-1], request.prompt_len, request.output_len, 0.0
                )
            record = await self._send(request, time.perf_counter())
            if not record.ok:
                raise RuntimeError(f"warm-up request to {self.settings.target} failed: {record.status}: {record.error}")

    async def run(self, start_at: float) -> list[RequestRecord]:
        """Send the share on its schedule from wall-clock time `start_at`; the records of every request."""
        await asyncio.sleep(max(0.0, start_at - time.time()))
        # the perf_counter reading at start_at, so that every client's offsets share one origin
        run_start = time.perf_counter() - (time.time() - start_at)
        slots = asyncio.Semaphore(self.max_concurrency) if self.max_concurrency else None
        in_flight = []
        for request in self.requests:
            await asyncio.sleep(max(0.0, request.arrival_s - (time.perf_counter() - run_start)))
            if slots is not None:
                await slots.acquire()
            in_flight.append(asyncio.create_task(self._send_in_slot(request, run_start, slots)))
        return [record for records in await asyncio.gather(*in_flight) for record in records]

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()

    def node(self) -> str:
        """The address of the Ray node this client actor runs on."""
        import ray

        return ray.util.get_node_ip_address()

    async def _send_in_slot(
        self, request: PlannedRequest, run_start: float, slots: asyncio.Semaphore | None
    ) -> list[RequestRecord]:
        """The request's record, or a conversation's records (one per turn, each turn sent when the
        previous reply is complete)."""
        try:
            turns = len(request.follow_ups) + 1
            if turns == 1:
                return [await self._send(request, run_start)]
            records, history = [], list(request.prompt)
            for t in range(turns):
                if t:
                    history += request.follow_ups[t - 1]
                turn = PlannedRequest(request.index * turns + t, list(history), len(history), request.output_len, 0.0)
                reply: list[int] = []
                records.append(await self._send(turn, run_start, reply))
                if not records[-1].ok:
                    break
                history += reply
            return records
        finally:
            if slots is not None:
                slots.release()

    async def _send(self, request: PlannedRequest, run_start: float, reply: list[int] | None = None) -> RequestRecord:
        sampling = dict(
            max_tokens=request.output_len, ignore_eos=self.settings.ignore_eos, temperature=self.settings.temperature
        )
        if self.settings.n > 1:
            sampling["n"] = self.settings.n
        if request.priority:
            sampling["priority"] = request.priority
        chunk_times: list[float] = []
        completion_tokens = 0
        final: Final | None = None
        status, error = "OK", ""
        sent = time.perf_counter()
        try:
            stream = self._connection().generate(request.prompt, timeout_s=self.settings.request_timeout_s, **sampling)
            async with contextlib.aclosing(stream):
                async for item in stream:
                    if isinstance(item, Chunk):
                        if item.token_ids:
                            chunk_times.append(time.perf_counter())
                            completion_tokens += len(item.token_ids)  # every completion's (n > 1)
                            if reply is not None:
                                reply += item.token_ids
                    else:
                        final = item  # n > 1: the last completion's
        except Exception as e:
            known = failure(e)
            if known is None:
                raise
            status, error = known
        ended = time.perf_counter()
        return RequestRecord(
            index=request.index,
            client=self.client_id,
            status=status,
            error=error,
            prompt_tokens=final.prompt_tokens if final else request.prompt_len,
            max_tokens=request.output_len,
            completion_tokens=completion_tokens,
            cached_tokens=final.cached_tokens if final else 0,
            finish_reason=final.finish_reason if final else None,
            start_s=sent - run_start,
            ttft_s=chunk_times[0] - sent if chunk_times else None,
            e2e_s=ended - sent,
            itl_s=np.diff(chunk_times).tolist(),
            priority=request.priority,
        )


# ---- running the clients ---------------------------------------------------------------------------------
async def server_prefix_tokens(settings: BenchSettings) -> tuple[int, int] | None:
    """(hit, queried) prompt tokens of the server's prefix cache since it started (GetModelInfo; None
    over HTTP or with caching off): what every completion of an n > 1 request took from the cache,
    where a request's own count holds the first completion's."""
    if settings.backend != "grpc":
        return None
    async with connect(settings) as client:
        info = (await client.model_info()).prefix_cache
    return (info.hit_tokens, info.query_tokens) if info.enabled else None


def _server_delta(before: tuple[int, int] | None, after: tuple[int, int] | None) -> tuple[int, int] | None:
    return None if before is None or after is None else (after[0] - before[0], after[1] - before[1])


async def _run_in_process(
    settings: BenchSettings, workload: list[PlannedRequest]
) -> tuple[list[RequestRecord], tuple[int, int] | None]:
    client = LoadClient(settings, 0, workload, settings.max_concurrency)
    try:
        await client.warmup()
        before = await server_prefix_tokens(settings)
        records = await client.run(time.time())
        return records, _server_delta(before, await server_prefix_tokens(settings))
    finally:
        await client.close()


def client_nodes(settings: BenchSettings) -> list[str]:
    """Ids of the alive Ray nodes to put clients on, this node first; each needs a CPU per client."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    per_node = settings.clients_per_node or 1
    usable = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) >= per_node]
    usable.sort(key=lambda node_id: node_id != here)
    wanted = settings.num_client_nodes or len(usable)
    if wanted > len(usable) or not usable:
        raise ValueError(
            f"{wanted or 1} client node(s) wanted, but {len(usable)} alive node(s) have the {per_node} CPU(s) "
            f"that {per_node} client(s) per node need"
        )
    return usable[:wanted]


def _run_on_ray(
    settings: BenchSettings, workload: list[PlannedRequest], address: str | None
) -> tuple[list[RequestRecord], list[str], tuple[int, int] | None]:
    """The merged records of all client actors, the node address of each (as the actor reports it) and
    the server's prefix-cache tokens over the run."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=True)  # address None: RAY_ADDRESS (set by ray job submit)
    nodes = client_nodes(settings)
    placements = [node_id for node_id in nodes for _ in range(settings.clients_per_node or 1)]
    limits = split_concurrency(settings.max_concurrency, len(placements))
    actor_class = ray.remote(num_cpus=1)(LoadClient)
    clients = [
        actor_class.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(
            settings, i, workload[i :: len(placements)], limits[i]
        )
        for i, node_id in enumerate(placements)
    ]
    try:
        where = ray.get([c.node.remote() for c in clients])
        ray.get([c.warmup.remote() for c in clients])
        before = asyncio.run(server_prefix_tokens(settings))
        start_at = time.time() + RAY_START_DELAY_S
        per_client = ray.get([c.run.remote(start_at) for c in clients])
        server = _server_delta(before, asyncio.run(server_prefix_tokens(settings)))
    finally:
        for c in clients:
            ray.kill(c)
    return [record for records in per_client for record in records], where, server


def run_benchmark(settings: BenchSettings, *, ray_address: str | None = None) -> BenchResult:
    """Plan the workload, run it (in-process, or on Ray client actors) and summarize the merged records."""
    settings.validate()

    async def plan() -> tuple[str, list[PlannedRequest]]:
        async with connect(settings) as client:
            return await plan_workload(settings, client)

    model, workload = asyncio.run(plan())
    nodes: list[str] = []
    if settings.uses_ray:
        records, nodes, server = _run_on_ray(settings, workload, ray_address)
    else:
        records, server = asyncio.run(_run_in_process(settings, workload))
    records.sort(key=lambda r: r.index)
    return BenchResult(settings, model, max(1, len(nodes)), records, summarize(records, server), nodes)


# ---- the report ------------------------------------------------------------------------------------------
def latency_stats_ms(values_s: list[float]) -> dict[str, float | None]:
    """mean, p50 (median), p90 and p99 in milliseconds; None when there are no values."""
    if not values_s:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ms = 1e3 * np.asarray(values_s)
    p50, p90, p99 = np.percentile(ms, [50, 90, 99]).tolist()
    return {"mean": float(ms.mean()), "p50": p50, "p90": p90, "p99": p99}


def summarize(records: list[RequestRecord], server_prefix: tuple[int, int] | None = None) -> dict:
    """Counts, throughputs over the run's duration (common start to the last stream's end) and latencies;
    server_prefix: the server's (hit, queried) prefix-cache tokens over the run (other traffic included)."""
    done = [r for r in records if r.ok]
    duration = max(r.start_s + r.e2e_s for r in records)
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.completion_tokens for r in done)
    latencies = {
        "ttft": [r.ttft_s for r in done if r.ttft_s is not None],
        "tpot": [(r.e2e_s - r.ttft_s) / (r.completion_tokens - 1) for r in done if r.completion_tokens > 1],
        "itl": [gap for r in done for gap in r.itl_s],
        "e2e": [r.e2e_s for r in done],
    }
    return {
        "completed": len(done),
        "failed": len(records) - len(done),
        "failures_by_status": dict(Counter(r.status for r in records if not r.ok)),
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        # prompt tokens the server's prefix cache skipped, over all prompt tokens sent
        "prefix_cache_hit_rate": sum(r.cached_tokens for r in done) / input_tokens if input_tokens else 0.0,
        "server_prefix_cache": None
        if server_prefix is None
        else {"hit_tokens": server_prefix[0], "query_tokens": server_prefix[1]},
        **{f"{name}_ms": latency_stats_ms(values) for name, values in latencies.items()},
        # each priority's time to first token (a mixed-priority run): what the policy buys the first
        "ttft_ms_by_priority": {
            str(p): latency_stats_ms([r.ttft_s for r in done if r.priority == p and r.ttft_s is not None])
            for p in sorted({r.priority for r in records})
        },
    }


def format_report(result: BenchResult) -> str:
    s, settings = result.summary, result.settings
    rate = "inf" if math.isinf(settings.request_rate) else f"{settings.request_rate:g}"
    lines = [
        "=" * 20 + " Serving Benchmark Result " + "=" * 20,
        f"{'Model:':<40}{result.model}",
        f"{'Target / backend / clients:':<40}{settings.target} / {settings.backend} / {result.num_clients}",
        *([f"{'Client nodes:':<40}{_node_counts(result.client_nodes)}"] if result.client_nodes else []),
        f"{'Request rate / max concurrency:':<40}{rate} / {result.settings.max_concurrency or 'unlimited'}",
        f"{'Successful requests:':<40}{s['completed']}",
        f"{'Failed requests:':<40}{s['failed']}"
        + "".join(f"  {code}: {count}" for code, count in sorted(s["failures_by_status"].items())),
        f"{'Benchmark duration (s):':<40}{s['duration_s']:.2f}",
        f"{'Total input tokens:':<40}{s['total_input_tokens']}",
        f"{'Prefix cache hit rate:':<40}{100 * s['prefix_cache_hit_rate']:.1f}%",
        *([_server_prefix_line(server)] if (server := s.get("server_prefix_cache")) else []),
        f"{'Total generated tokens:':<40}{s['total_output_tokens']}",
        f"{'Request throughput (req/s):':<40}{s['request_throughput']:.2f}",
        f"{'Output token throughput (tok/s):':<40}{s['output_throughput']:.2f}",
        f"{'Total token throughput (tok/s):':<40}{s['total_token_throughput']:.2f}",
        "-" * 66,
        f"{'(ms)':<10}{'mean':>14}{'median':>14}{'p90':>14}{'p99':>14}",
    ]
    for name in LATENCY_METRICS:
        stats = s[f"{name}_ms"]
        cells = "".join(f"{'-' if v is None else f'{v:.2f}':>14}" for v in stats.values())
        lines.append(f"{name.upper():<10}{cells}")
    by_priority = s.get("ttft_ms_by_priority", {})
    for priority, stats in by_priority.items() if len(by_priority) > 1 else ():
        cells = "".join(f"{'-' if v is None else f'{v:.2f}':>14}" for v in stats.values())
        lines.append(f"{'TTFT p' + priority:<10}{cells}")
    lines.append("=" * 66)
    return "\n".join(lines)


def _server_prefix_line(counts: dict) -> str:
    hit, queried = counts["hit_tokens"], counts["query_tokens"]
    rate = f" ({100 * hit / queried:.1f}%)" if queried else ""
    return f"{'Server prefix cache (hit / queried):':<40}{hit} / {queried} tokens{rate}"


def _node_counts(nodes: list[str]) -> str:
    return ", ".join(f"{ip} x{n}" for ip, n in sorted(Counter(nodes).items()))


def report_json(result: BenchResult, *, with_requests: bool) -> dict:
    settings = asdict(result.settings)
    if math.isinf(settings["request_rate"]):
        settings["request_rate"] = "inf"  # strict JSON has no Infinity
    report = {"settings": settings, "model": result.model, "num_clients": result.num_clients}
    report.update(client_nodes=result.client_nodes, **result.summary)
    if with_requests:
        report["requests"] = [asdict(r) for r in result.records]
    return report


# ---- the command -----------------------------------------------------------------------------------------
def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="load generator against a running server, gRPC or OpenAI HTTP (in-process or Ray client actors)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--target", default="127.0.0.1:50051", help="the server's host:port (gRPC) or its HTTP URL (openai)")
    p.add_argument(
        "--backend", default="grpc", choices=BACKENDS, help="grpc: Generate; openai: streamed /v1/completions"
    )
    g = p.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=1000)
    g.add_argument("--input-len", type=int, default=1024, help="prompt tokens")
    g.add_argument("--output-len", type=int, default=128, help="max_tokens of each request")
    g.add_argument(
        "--range-ratio", type=float, default=0.0, help="lengths uniform in [len*(1-r), len*(1+r)] (0: fixed)"
    )
    g.add_argument("--dataset-path", default=None, help="sample prompts from this text file (default: random ids)")
    g.add_argument(
        "--prompt-format",
        default="token_ids",
        choices=["token_ids", "text"],
        help="send dataset windows as token ids (exact lengths) or as text for the server to tokenize",
    )
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--n", type=int, default=1, help="completions of each prompt (its tokens all count as output)")
    g.add_argument(
        "--ignore-eos", action=argparse.BooleanOptionalAction, default=True, help="generate exactly the output length"
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--num-turns", type=int, default=1, help="conversations of this many turns, each resending the history"
    )
    g.add_argument("--shared-prefix-len", type=int, default=0, help="tokens every request starts with")
    g.add_argument(
        "--priority-fraction",
        type=float,
        default=0.0,
        help="this share of the requests at priority 0, the rest at 1 (a server under --scheduling-policy"
        " priority); the report gives each one's TTFT",
    )
    g = p.add_argument_group("load")
    g.add_argument(
        "--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (inf: all at once)"
    )
    g.add_argument("--max-concurrency", type=int, default=None, help="requests in flight, over all clients")
    g.add_argument("--num-warmups", type=int, default=2, help="uncounted requests per client before the run")
    g.add_argument("--request-timeout", type=float, default=None, help="seconds; past it a request fails")
    g = p.add_argument_group("Ray clients (with either flag the clients run as Ray actors)")
    g.add_argument("--clients-per-node", type=int, default=None, help="client actors on each node (default 1)")
    g.add_argument("--num-client-nodes", type=int, default=None, help="nodes to use (default: every alive one)")
    g.add_argument("--ray-address", default=None, help="the Ray cluster (default: RAY_ADDRESS, or a local one)")
    g = p.add_argument_group("output")
    g.add_argument("--json", default=None, help="write the summary (and settings) here")
    g.add_argument("--save-requests", action="store_true", help="also put every request's record in the JSON")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    settings = BenchSettings(
        target=args.target,
        backend=args.backend,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        dataset_path=args.dataset_path,
        prompt_format=args.prompt_format,
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        num_warmups=args.num_warmups,
        seed=args.seed,
        temperature=args.temperature,
        n=args.n,
        ignore_eos=args.ignore_eos,
        request_timeout_s=args.request_timeout,
        num_turns=args.num_turns,
        shared_prefix_len=args.shared_prefix_len,
        priority_fraction=args.priority_fraction,
        clients_per_node=args.clients_per_node,
        num_client_nodes=args.num_client_nodes,
    )
    try:
        result = run_benchmark(settings, ray_address=args.ray_address)
    except ValueError as e:  # settings that do not fit each other or the server
        print(f"bench serve: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # planning could not talk to the server
        known = failure(e)
        if known is None:
            raise
        print(f"bench serve: {settings.target}: {known[0]}: {known[1]}", file=sys.stderr)
        return 2
    print(format_report(result), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report_json(result, with_requests=args.save_requests), f, indent=1)
    return 0 if result.summary["completed"] else 1
