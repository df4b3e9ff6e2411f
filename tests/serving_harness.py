"""What the serving tests share (the gRPC gateway's now; an HTTP front door can reuse it): an asyncio
loop on a thread for blocking clients, an in-process server started and stopped in front of an
AsyncEngine, streamed outputs collected, the pool checked idle, and the process's resources (RSS,
shared-memory segments, live Ray actors) measured for leak checks."""

from __future__ import annotations

import asyncio
import math
import os
import socket
import threading
import time
from dataclasses import dataclass

from hypothesis import strategies as st

from deltaserve.cluster.config import EngineConfig
from deltaserve.cluster.entrypoints.async_engine import AsyncEngine
from deltaserve.cluster.entrypoints.client import Chunk, Final
from deltaserve.cluster.entrypoints.gateway import Gateway
from deltaserve.protos import generation_pb2 as pb

CALL_TIMEOUT_S = 30


class LoopThread:
    """An asyncio loop on a thread of its own, so that tests can use blocking gRPC clients."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="gateway-loop", daemon=True)
        self._thread.start()

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro, timeout_s: float = CALL_TIMEOUT_S):
        return self.submit(coro).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


@dataclass
class Served:
    aio: LoopThread
    engine: AsyncEngine
    gateway: Gateway

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.gateway.port}"

    def stats(self) -> dict:
        return self.aio.run(self.engine.stats())


@dataclass
class Streamed:
    chunks: list[Chunk]
    final: Final

    @property
    def token_ids(self) -> list[int]:
        return [t for c in self.chunks for t in c.token_ids]

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.chunks)


def collect(items) -> Streamed:
    items = list(items)
    assert isinstance(items[-1], Final) and all(isinstance(i, Chunk) for i in items[:-1])
    return Streamed(items[:-1], items[-1])


def start_served(aio: LoopThread, engine_config: EngineConfig) -> Served:
    engine = aio.run(AsyncEngine.local(engine_config))
    gateway = Gateway(engine)
    try:
        aio.run(gateway.start())
    except BaseException:
        aio.run(engine.shutdown())
        raise
    return Served(aio, engine, gateway)


def stop_served(served: Served) -> None:
    try:
        served.aio.run(served.gateway.stop(0))
    finally:
        served.aio.run(served.engine.shutdown())


def wait_for_idle_pool(served: Served, within_s: float = 1.0) -> None:
    """Every page and state slot free again, nothing running or waiting, within `within_s`."""
    deadline = time.monotonic() + within_s
    while True:
        stats = served.stats()
        idle = stats["running"] == 0 and stats["waiting"] == 0 and served.engine.num_streams == 0
        if idle and stats["free_pages"] == stats["total_pages"] and stats["free_slots"] == stats["total_slots"]:
            return
        assert time.monotonic() < deadline, f"the pool is not free {within_s} s later: {stats}"
        time.sleep(0.01)


# ---- the rule every front door keeps -----------------------------------------------------------------
MAX_ERROR_BYTES = 1024
# the names an error may start with: every request field, plus the prompt as a whole, a prompt's ids,
# and the message itself (bytes that do not parse)
FIELD_NAMES = frozenset(
    [f.name for f in pb.SamplingParams.DESCRIPTOR.fields]
    + [f.name for f in pb.GenerateRequest.DESCRIPTOR.fields]
    + [f.name for f in pb.TokenizeRequest.DESCRIPTOR.fields]
    + ["prompt", "prompt_token_ids", "request", "sampling_params"]
)


def error_problem(field_error: bool, message: str) -> str | None:
    """Why an error message breaks the rule (None when it keeps it): under MAX_ERROR_BYTES and, for a
    bad-input error, naming a field first ("<field>: ...")."""
    if len(message.encode()) >= MAX_ERROR_BYTES:
        return f"{len(message.encode())} bytes"
    if field_error and message.split(":", 1)[0] not in FIELD_NAMES:
        return f"names no field: {message[:120]!r}"
    return None


# ---- request strategies (hypothesis): plain dicts, so that a JSON front door can send the same ----------
INT32 = (-(2**31), 2**31 - 1)
HUGE_TEXT = "x" * 20_000


FLOAT_EDGES = [
    math.nan,
    math.inf,
    -math.inf,
    1e300,
    -1e300,
    3.5e38,
    3.4e38,
    -1.0,
    -0.0,
    0.0,
    5e-324,
    1e-40,
    9.99e-6,
    1e-5,
]
INT32_EDGES = [-(2**31), -2, -1, 0, 1, 2, 2**31 - 1]


def extreme_floats():
    return st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(FLOAT_EDGES))


def int32s():
    return st.one_of(st.integers(*INT32), st.sampled_from(INT32_EDGES))


def token_id_lists(vocab_size: int):
    return st.one_of(
        st.lists(st.integers(0, vocab_size - 1), max_size=12),  # mostly valid
        st.lists(int32s(), max_size=12),
        st.just([]),
        st.integers(0, vocab_size - 1).map(lambda t: [t] * 100_000),  # a huge repeated field
    )


def texts():
    plain = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)  # proto strings are UTF-8
    return st.one_of(plain, st.just(""), st.just(HUGE_TEXT))


def valid_sampling_fields(vocab_size: int) -> dict:
    """Per field, a strategy for values SamplingParams accepts (generations stay short)."""
    unit = st.floats(0.0, 1.0)
    return {
        "max_tokens": st.integers(1, 4),
        "min_tokens": st.integers(0, 1),
        "temperature": st.one_of(st.floats(0.0, 2.0), st.sampled_from([0.0, 5e-324, 1e-40, 9.99e-6, 1e-5])),
        "top_p": st.floats(5e-324, 1.0),
        "top_k": st.one_of(st.integers(-1, vocab_size + 1), st.just(2**31 - 1)),
        "min_p": unit,
        "seed": st.integers(0, 2**63 - 1),
        "repetition_penalty": st.one_of(st.floats(0.01, 10.0), st.sampled_from([5e-324, 3.4e38])),
        "presence_penalty": st.floats(-2.0, 2.0),
        "frequency_penalty": st.floats(-2.0, 2.0),
        "stop": st.lists(st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=8), max_size=3),
        "stop_token_ids": st.lists(st.integers(0, vocab_size - 1), max_size=3),
        "ignore_eos": st.booleans(),
        "include_stop_str_in_output": st.booleans(),
        "logprobs": st.integers(0, 20),
        "prompt_logprobs": st.integers(0, 20),
        "skip_special_tokens": st.booleans(),
        "n": st.just(1),
    }


def extreme_sampling_fields() -> dict:
    """Per field, a strategy for values at and past its edges (most of them refused)."""
    return {
        "max_tokens": int32s(),
        "min_tokens": int32s(),
        "temperature": extreme_floats(),
        "top_p": extreme_floats(),
        "top_k": int32s(),
        "min_p": extreme_floats(),
        "seed": st.one_of(st.integers(-(2**63), 2**63 - 1), st.sampled_from([-1, 2**63 - 1])),
        "repetition_penalty": extreme_floats(),
        "presence_penalty": extreme_floats(),
        "frequency_penalty": extreme_floats(),
        "stop": st.one_of(st.lists(texts(), max_size=3), st.just(["ab"] * 40), st.just([HUGE_TEXT]), st.just([""])),
        "stop_token_ids": st.one_of(st.lists(int32s(), max_size=3), st.just([3] * 20_000)),
        "logprobs": int32s(),
        "prompt_logprobs": int32s(),
        "n": int32s(),
    }


@st.composite
def sampling_fields(draw, vocab_size: int) -> dict:
    """A dict of SamplingParams fields: some valid ones (each present or not), then zero to three of
    them at or past an edge, so that one bad value is often alone (and must be the one refused)."""
    fields = draw(st.fixed_dictionaries({}, optional=valid_sampling_fields(vocab_size)))
    extremes = extreme_sampling_fields()
    for name in draw(st.lists(st.sampled_from(sorted(extremes)), max_size=3, unique=True)):
        fields[name] = draw(extremes[name])
    return fields


@st.composite
def one_bad_field(draw, vocab_size: int) -> tuple[list[int], str, dict]:
    """(a valid token-id prompt, a field name, sampling fields valid but for that one at an edge)."""
    prompt = draw(st.lists(st.integers(3, vocab_size - 1), min_size=1, max_size=8))
    fields = draw(st.fixed_dictionaries({}, optional=valid_sampling_fields(vocab_size)))
    extremes = extreme_sampling_fields()
    name = draw(st.sampled_from(sorted(extremes)))
    fields[name] = draw(extremes[name])
    return prompt, name, fields


def edge_values() -> list[tuple[str, object]]:
    """Every (field, value) of the edge table: each float field at each float edge, each integer field
    at each int32 edge, the seed at int64's, and the repeated fields empty, huge or holding a bad item."""
    floats = [f.name for f in pb.SamplingParams.DESCRIPTOR.fields if f.type == f.TYPE_DOUBLE]
    ints = [f.name for f in pb.SamplingParams.DESCRIPTOR.fields if f.type == f.TYPE_INT32 and not f.is_repeated]
    cases = [(name, v) for name in floats for v in FLOAT_EDGES] + [(name, v) for name in ints for v in INT32_EDGES]
    cases += [("seed", v) for v in (-(2**63), -1, 0, 2**63 - 1)]
    cases += [("stop", v) for v in ([], [""], ["ab"] * 33, [HUGE_TEXT], ["\x00"], ["\U0010ffff"])]
    cases += [("stop_token_ids", v) for v in ([], [-1], [2**31 - 1], [3] * 33, [3] * 20_000)]
    return cases


# a value of the key may also be refused under these names (min_tokens is checked against max_tokens)
RELATED_FIELDS = {"max_tokens": {"min_tokens"}}


def generate_requests(vocab_size: int):
    """(prompt, request_id, sampling dict): prompt is text, token ids, or None (no prompt at all)."""
    valid = st.one_of(
        st.lists(st.integers(3, vocab_size - 1), min_size=1, max_size=12),
        st.text(st.characters(min_codepoint=32, max_codepoint=126), min_size=1, max_size=30),
    )
    prompt = st.one_of(valid, valid, valid, texts(), token_id_lists(vocab_size), st.none())  # valid ones weigh 3 in 6
    request_id = st.one_of(st.just(""), st.text(max_size=8), st.just("r" * 300), st.just(HUGE_TEXT))
    request_id = st.one_of(st.just(""), st.just(""), st.just(""), request_id)
    return st.tuples(prompt, request_id, sampling_fields(vocab_size))


# ---- resources ---------------------------------------------------------------------------------------
def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size of a process (Linux /proc)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def shm_segments() -> set[str]:
    """Names in /dev/shm (POSIX shared-memory segments, ours and everyone's on this machine)."""
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def live_ray_actors() -> list[str]:
    """Class names of the actors the current Ray cluster has alive (the GCS's table: no dashboard)."""
    from ray._private import state

    return sorted(a["ActorClassName"] for a in state.actors().values() if a["State"] != "DEAD")


def descendant_pids(root: int | None = None) -> set[int]:
    """The pids under `root` (this process by default), from /proc: Ray's raylet and its workers."""
    parent_of = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent_of[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    found, frontier = set(), {root or os.getpid()}
    while frontier:
        frontier = {pid for pid, parent in parent_of.items() if parent in frontier} - found
        found |= frontier
    return found


def shm_segments_of(pids: set[int]) -> set[str]:
    """The shared-memory rings' segments (named dsc_<creator pid>_...) that any of `pids` created."""
    mine = set()
    for name in shm_segments():
        parts = name.split("_")
        if name.startswith("dsc_") and len(parts) > 2 and parts[1].isdigit() and int(parts[1]) in pids:
            mine.add(name)
    return mine


# ---- a `ray start --head` of its own ----------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def own_head_ports() -> list[str]:
    """`ray start --head` flags giving each of its side ports a free one: the suite's other Ray
    instance holds the defaults (its agent: 52365)."""
    flags = (
        "dashboard-agent-listen-port",
        "dashboard-agent-grpc-port",
        "runtime-env-agent-port",
        "metrics-export-port",
        "ray-client-server-port",
        "node-manager-port",
        "object-manager-port",
    )
    return [f"--{flag}={free_port()}" for flag in flags]
