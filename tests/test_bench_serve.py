"""`deltaserve bench serve` against a real gateway on 127.0.0.1 (tiny model, local engine): the report
counts every request and token, its latencies are consistent per request, the concurrency limit and
the Poisson schedule hold, failures are counted by gRPC status, and Ray client actors merge into one
report."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from deltaserve.bench.serve import BenchSettings, PlannedRequest, RequestRecord, plan_workload, run_benchmark
from deltaserve.cli import main
from deltaserve.cluster.config import EngineConfig
from deltaserve.cluster.entrypoints.async_engine import AsyncEngine
from deltaserve.cluster.entrypoints.client import AsyncGenerationClient
from deltaserve.cluster.entrypoints.gateway import Gateway

pytestmark = pytest.mark.timeout(60)

STARTUP_TIMEOUT_S = 60
TEXT = "The quick brown fox jumps over the lazy dog.\nPack my box with five dozen liquor jugs.\n" * 20


class ServedGateway:
    """A gateway and a local engine on an asyncio loop of their own thread (the benchmark runs its
    own loop on the test's thread)."""

    def __init__(self, config: EngineConfig):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="bench-gateway-loop", daemon=True)
        self.thread.start()
        self.engine = self._run(AsyncEngine.local(config))
        self.gateway = Gateway(self.engine)
        try:
            self._run(self.gateway.start())
        except BaseException:
            self.stop()
            raise

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.gateway.port}"

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(STARTUP_TIMEOUT_S)

    def stop(self) -> None:
        try:
            self._run(self.gateway.stop(0))
            self._run(self.engine.shutdown())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join()
            self.loop.close()


@pytest.fixture(scope="module")
def model_path(tiny_checkpoints) -> str:
    return str(tiny_checkpoints["qwen3_next"][0])


@pytest.fixture(scope="module")
def target(model_path) -> Iterator[str]:
    served = ServedGateway(EngineConfig.from_kwargs(model=model_path))
    try:
        yield served.target
    finally:
        served.stop()


def assert_consistent(records: list[RequestRecord], num_prompts: int) -> None:
    """One successful record per planned request, with latencies that fit together."""
    assert [r.index for r in records] == list(range(num_prompts))
    for r in records:
        assert (r.status, r.error, r.finish_reason) == ("OK", "", "length"), r
        assert r.completion_tokens == r.max_tokens  # ignore_eos makes every output exactly its planned length
        assert 0 < r.ttft_s <= r.e2e_s
        assert len(r.itl_s) >= 1 and all(gap >= 0 for gap in r.itl_s)
        assert r.ttft_s + sum(r.itl_s) <= r.e2e_s + 1e-9  # the last chunk came before the stream ended


def max_in_flight(records: list[RequestRecord]) -> int:
    events = sorted([(r.start_s, 1) for r in records] + [(r.start_s + r.e2e_s, -1) for r in records])
    return max(np.cumsum([change for _, change in events]))


def test_fixed_lengths_through_the_cli(target, tmp_path, capsys):
    path = tmp_path / "serve.json"
    argv = ["bench", "serve", "--target", target, "--num-prompts", "12", "--max-concurrency", "4"]
    argv += ["--input-len", "8", "--output-len", "6", "--json", str(path), "--save-requests"]
    assert main(argv) == 0
    assert "Successful requests:" in capsys.readouterr().out
    report = json.loads(path.read_text())
    assert (report["completed"], report["failed"], report["failures_by_status"]) == (12, 0, {})
    assert (report["total_input_tokens"], report["total_output_tokens"]) == (12 * 8, 12 * 6)
    assert report["settings"]["request_rate"] == "inf"
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        stats = report[metric]
        assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"], (metric, stats)
        assert stats["mean"] > 0
    duration = report["duration_s"]
    assert report["output_throughput"] == pytest.approx(12 * 6 / duration)
    assert report["total_token_throughput"] == pytest.approx(12 * (8 + 6) / duration)
    records = [RequestRecord(**r) for r in report["requests"]]
    assert_consistent(records, 12)
    assert all(r.prompt_tokens == 8 for r in records)
    assert max_in_flight(records) <= 4
    assert max(r.start_s + r.e2e_s for r in records) == pytest.approx(duration)


def test_n_completions_count_every_completion(target, tmp_path, capsys):
    """--n 3: each request streams three completions of its prompt; the report counts all their
    tokens as output, and the server's prefix-cache counts over the run show the prompt prefilled
    once: the other two completions of each prompt start from the first one's cache (a request's own
    count holds the first completion's hit, from earlier traffic only)."""
    path = tmp_path / "n.json"
    argv = ["bench", "serve", "--target", target, "--num-prompts", "4", "--n", "3", "--max-concurrency", "2"]
    argv += ["--input-len", "20", "--output-len", "5", "--json", str(path), "--save-requests", "--num-warmups", "0"]
    assert main(argv) == 0
    report = json.loads(path.read_text())
    assert (report["completed"], report["failed"], report["total_output_tokens"]) == (4, 0, 4 * 3 * 5)
    assert all(r["completion_tokens"] == 15 and r["finish_reason"] == "length" for r in report["requests"])
    server = report["server_prefix_cache"]
    assert server["query_tokens"] == 4 * 3 * 20
    # each follower starts at the first completion's snapshot at the last page boundary before the
    # prompt's last token (pages of CacheConfig's default 16 tokens): 16 of its 20
    leads = sum(r["cached_tokens"] for r in report["requests"])
    assert leads < 4 * 16 and server["hit_tokens"] == leads + 4 * 2 * 16
    hit = server["hit_tokens"]
    line = f"Server prefix cache (hit / queried):    {hit} / 240 tokens ({100 * hit / 240:.1f}%)"
    assert line in capsys.readouterr().out


def test_a_priority_mix_reports_each_priority(model_path, tmp_path):
    """--priority-fraction 0.25 against a server under --scheduling-policy priority with two sequences:
    a quarter of the requests (drawn from the seed) go at priority 0 and jump the queue of the others,
    so their first tokens come sooner; the report gives each priority's TTFT."""
    served = ServedGateway(EngineConfig.from_kwargs(model=model_path, max_num_seqs=2, scheduling_policy="priority"))
    try:
        path = tmp_path / "priority.json"
        argv = ["bench", "serve", "--target", served.target, "--num-prompts", "16", "--priority-fraction", "0.25"]
        argv += ["--input-len", "8", "--output-len", "12", "--json", str(path), "--save-requests"]
        assert main(argv) == 0
    finally:
        served.stop()
    report = json.loads(path.read_text())
    assert (report["completed"], report["failed"]) == (16, 0)
    priorities = [r["priority"] for r in report["requests"]]
    assert set(priorities) == {0, 1} and 1 <= priorities.count(0) <= 8
    by_priority = report["ttft_ms_by_priority"]
    assert by_priority["0"]["p50"] < by_priority["1"]["p50"]


def test_multi_turn_conversations_hit_the_prefix_cache(target, tmp_path):
    """Each turn resends the shared prefix, the history and the replies: the report counts every turn,
    and from the second turn on the server skips what it has seen."""
    path = tmp_path / "turns.json"
    argv = ["bench", "serve", "--target", target, "--num-prompts", "4", "--num-turns", "3", "--max-concurrency", "2"]
    argv += ["--shared-prefix-len", "40", "--input-len", "5", "--output-len", "4", "--json", str(path)]
    argv += ["--save-requests", "--num-warmups", "0"]
    assert main(argv) == 0
    report = json.loads(path.read_text())
    assert (report["completed"], report["failed"]) == (12, 0)
    records = sorted((RequestRecord(**r) for r in report["requests"]), key=lambda r: r.index)
    for conv in range(4):
        turns = records[3 * conv : 3 * conv + 3]
        assert [r.prompt_tokens for r in turns] == [45, 45 + 4 + 5, 45 + 2 * (4 + 5)]
        assert turns[1].cached_tokens > 40 and turns[2].cached_tokens > turns[1].cached_tokens
    assert report["prefix_cache_hit_rate"] == pytest.approx(
        sum(r.cached_tokens for r in records) / sum(r.prompt_tokens for r in records)
    )
    assert report["prefix_cache_hit_rate"] > 0.5


@pytest.mark.parametrize("prompt_format", ["token_ids", "text"])
def test_poisson_arrivals_and_text_dataset(target, tmp_path, prompt_format):
    dataset = tmp_path / "corpus.txt"
    dataset.write_text(TEXT)
    settings = BenchSettings(
        target=target,
        num_prompts=10,
        input_len=16,
        output_len=5,
        range_ratio=0.5,
        dataset_path=str(dataset),
        prompt_format=prompt_format,
        request_rate=40.0,
        num_warmups=1,
        seed=3,
    )
    result = run_benchmark(settings)
    assert_consistent(result.records, 10)
    assert result.summary["total_output_tokens"] == sum(r.max_tokens for r in result.records)
    workload, text_ids = asyncio.run(plan_with_text_ids(settings))  # the same seed plans the same workload
    input_lens = [p.prompt_len for p in workload]
    assert min(input_lens) >= 8 and max(input_lens) <= 24 and len(set(input_lens)) > 1
    assert [r.max_tokens for r in result.records] == [p.output_len for p in workload]
    if prompt_format == "token_ids":
        assert [r.prompt_tokens for r in result.records] == input_lens
        assert all(set(p.prompt) <= set(text_ids) for p in workload)
    else:  # text windows sized by the file's characters per token: about as long
        assert all(isinstance(p.prompt, str) and p.prompt in TEXT + TEXT for p in workload)
        assert all(0.5 * n <= r.prompt_tokens <= 2 * n for r, n in zip(result.records, input_lens, strict=True))
    # sent no earlier than the Poisson schedule says, which spreads the requests out
    arrivals = [p.arrival_s for p in workload]
    assert arrivals == sorted(arrivals) and arrivals[-1] > 0.05
    assert all(r.start_s >= a - 1e-3 for r, a in zip(result.records, arrivals, strict=True))


async def plan_with_text_ids(settings: BenchSettings) -> tuple[list[PlannedRequest], list[int]]:
    async with AsyncGenerationClient(settings.target) as client:
        _, workload = await plan_workload(settings, client)
        return workload, await client.tokenize(TEXT)


def test_failures_are_counted_by_status(model_path):
    # one sequence slot and one queue place: most of a burst of 8 is refused with RESOURCE_EXHAUSTED
    served = ServedGateway(EngineConfig.from_kwargs(model=model_path, max_num_seqs=1, max_waiting_requests=1))
    try:
        settings = BenchSettings(target=served.target, num_prompts=8, input_len=8, output_len=30, num_warmups=0)
        result = run_benchmark(settings)
    finally:
        served.stop()
    summary = result.summary
    assert summary["completed"] >= 1 and summary["failed"] >= 1
    assert summary["completed"] + summary["failed"] == 8
    assert summary["failures_by_status"] == {"RESOURCE_EXHAUSTED": summary["failed"]}
    failed = [r for r in result.records if not r.ok]
    assert all(r.completion_tokens == 0 and r.ttft_s is None and "queue is full" in r.error for r in failed)
    assert summary["total_output_tokens"] == 30 * summary["completed"]
    assert summary["request_throughput"] == pytest.approx(summary["completed"] / summary["duration_s"])


@pytest.mark.ray
def test_ray_client_actors_merge_into_one_report(ray_session, target):
    settings = BenchSettings(
        target=target, num_prompts=12, input_len=8, output_len=6, max_concurrency=4, num_warmups=1, clients_per_node=2
    )
    result = run_benchmark(settings)
    assert result.num_clients == 2
    assert_consistent(result.records, 12)
    assert [r.client for r in result.records] == [i % 2 for i in range(12)]  # dealt round-robin
    assert (result.summary["completed"], result.summary["total_output_tokens"]) == (12, 12 * 6)
    assert max_in_flight(result.records) <= 4  # the limit is the total over both clients
