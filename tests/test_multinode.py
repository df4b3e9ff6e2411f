"""Data-parallel serving on a real two-node Ray cluster on this machine (`multinode.py`: one network
namespace per Ray node; Ray's own test cluster where namespaces cannot be made).

`deltaserve serve --data-parallel-size 2` is submitted with `ray job submit` from outside the
namespaces; its gateway on the head node is reached through the head's address. One replica runs on
each node (each replica's node id, as its driver reports it, against Ray's list of nodes), 64
concurrent streams give a single replica's greedy tokens and use both replicas; `bench serve
--clients-per-node 1` runs a client on each node and prints one report; killing the worker node's
processes fails only its replica's requests in flight, the other replica serves on, and the replica
comes back when the node does; `ray job stop` leaves no actor, placement group or process behind.
One cluster and one served job for the module: each start costs seconds on two cores.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass

import grpc
import pytest
import torch
from multinode import BIN, NetnsCluster, make_cluster
from tiny_models import VOCAB_SIZE

from deltaserve import LLM, SamplingParams
from deltaserve.cluster.entrypoints.client import AsyncGenerationClient, Chunk, Final, GenerationClient

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(180)]

GREEDY = dict(temperature=0, max_tokens=12, ignore_eos=True)
LONG = dict(temperature=0, max_tokens=480, ignore_eos=True)  # seconds of decoding on two busy cores
SERVE_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def cluster():
    c = make_cluster(2)
    try:
        yield c
    finally:
        c.close()
        if isinstance(c, NetnsCluster):
            assert c.leftovers() == [], "the test cluster left these behind"


@pytest.fixture(scope="module")
def model(tiny_checkpoints) -> str:
    return str(tiny_checkpoints["qwen3_next"][0])


@pytest.fixture(scope="module")
def reference(model):
    llm = LLM(model)
    yield llm
    llm.shutdown()


# ---- the job API -----------------------------------------------------------------------------------------
def ray_cli(cluster, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "ray"), *args], env=cluster.env, capture_output=True, text=True, timeout=timeout_s)


def rest(cluster, path: str):
    with urllib.request.urlopen(cluster.dashboard + path, timeout=10) as response:
        return json.load(response)


def job_logs(cluster, job: str) -> str:
    return rest(cluster, f"/api/jobs/{job}/logs")["logs"]


def job_status(cluster, job: str) -> str:
    return rest(cluster, f"/api/jobs/{job}")["status"]


def submit(cluster, job: str, *command: str, wait: bool) -> subprocess.CompletedProcess:
    """`ray job submit` from this (the host's) namespace, through the head's dashboard address."""
    argv = ["job", "submit", "--address", cluster.dashboard, "--submission-id", job]
    argv += [] if wait else ["--no-wait"]
    deadline = time.monotonic() + 60
    while True:  # the head answers before its job agent is up: retry until it takes jobs
        done = ray_cli(cluster, *argv, "--", *command, timeout_s=SERVE_TIMEOUT_S)
        if done.returncode == 0 or "No available agent" not in done.stderr or time.monotonic() > deadline:
            return done
        time.sleep(1)


def alive_ray_nodes(cluster) -> dict[str, str]:
    """node id -> address of every alive node, as Ray lists them."""
    nodes = rest(cluster, "/api/v0/nodes?limit=100")["data"]["result"]["result"]
    return {n["node_id"]: n["node_ip"] for n in nodes if n["state"] == "ALIVE"}


# ---- the served job --------------------------------------------------------------------------------------
@dataclass
class Served:
    job: str
    target: str
    stopped: bool = False

    def info(self):
        with GenerationClient(self.target) as client:
            return client.model_info(timeout_s=10)


@pytest.fixture(scope="module")
def served(cluster, model):
    job = f"dp2-{int(time.time())}"
    command = [str(BIN / "deltaserve"), "serve", "--model", model, "--device", "cpu", "--data-parallel-size", "2"]
    command += ["--host", "0.0.0.0", "--port", "0", "--http-port", "0", "--grace", "1", "--replica-down-after-s", "5"]
    done = submit(cluster, job, *command, wait=False)
    assert done.returncode == 0, done.stderr
    deadline = time.monotonic() + SERVE_TIMEOUT_S
    while not (found := re.search(r"serving \S+ from .* on grpc [\d.]+:(\d+)", job_logs(cluster, job))):
        status = job_status(cluster, job)
        assert status in ("PENDING", "RUNNING"), f"{status}: {job_logs(cluster, job)[-3000:]}"
        assert time.monotonic() < deadline, f"not serving after {SERVE_TIMEOUT_S} s: {job_logs(cluster, job)[-3000:]}"
        time.sleep(0.5)
    handle = Served(job, f"{cluster.nodes[0].ip}:{found.group(1)}")
    try:
        yield handle
    finally:
        if not handle.stopped:
            ray_cli(cluster, "job", "stop", "--address", cluster.dashboard, job)


def replica_nodes(info) -> dict[int, str]:
    return {r.index: r.node_id for r in info.replicas}


def prompts(n: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB_SIZE, (int(k),), generator=g).tolist() for k in torch.arange(n) % 29 + 2]


async def stream_all(target: str, cases: list[tuple[list[int], dict]]) -> list[tuple[list[int], Final | None, str]]:
    """(tokens, final, status) of each case, all streamed at once through one channel."""
    async with AsyncGenerationClient(target) as client:

        async def one(prompt, sampling):
            tokens, final = [], None
            try:
                async for item in client.generate(prompt, timeout_s=SERVE_TIMEOUT_S, **sampling):
                    if isinstance(item, Chunk):
                        tokens += item.token_ids
                    else:
                        final = item
            except grpc.aio.AioRpcError as e:
                return tokens, None, e.code().name
            return tokens, final, "OK"

        return await asyncio.gather(*(one(p, s) for p, s in cases))


# ---- the tests ---------------------------------------------------------------------------------------------
def test_one_replica_per_node_and_64_streams_equal_a_single_replica(cluster, served, reference):
    info = served.info()
    assert info.parallel.data_parallel_size == 2 and len(info.replicas) == 2
    nodes = alive_ray_nodes(cluster)
    assert len(nodes) == 2
    # each replica's driver reports its Ray node; the two are the cluster's two nodes
    assert sorted(replica_nodes(info).values()) == sorted(nodes)
    for r in info.replicas:
        assert (r.state, r.node_ip, r.transport) == ("up", nodes[r.node_id], "shm")  # driver beside its worker
    before = {r.index: r.routed for r in info.replicas}

    batch = prompts(64)
    results = asyncio.run(stream_all(served.target, [(p, GREEDY) for p in batch]))
    expected = reference.generate(batch, SamplingParams(**GREEDY), use_tqdm=False)
    assert [status for _, _, status in results] == ["OK"] * 64
    assert [tokens for tokens, _, _ in results] == [e.outputs[0].token_ids for e in expected]
    routed = {r.index: r.routed - before[r.index] for r in served.info().replicas}
    assert sum(routed.values()) == 64 and min(routed.values()) > 0, routed  # both replicas served


def test_bench_serve_with_a_client_on_each_node(cluster, served):
    command = [str(BIN / "deltaserve"), "bench", "serve", "--target", served.target, "--clients-per-node", "1"]
    command += ["--num-prompts", "16", "--input-len", "8", "--output-len", "6", "--num-warmups", "1"]
    done = submit(cluster, f"bench-{int(time.time())}", *command, wait=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = done.stdout
    assert report.count("Serving Benchmark Result") == 1  # one merged report
    assert re.search(r"Target / backend / clients:\s+\S+ / grpc / 2\n", report), report
    assert re.search(r"Successful requests:\s+16\n", report) and re.search(r"Failed requests:\s+0\s*\n", report)
    assert re.search(r"Total generated tokens:\s+96\n", report), report
    # one client on each node, as each client actor reports its node's address (one address for all the
    # nodes of Ray's local test cluster)
    clients = re.search(r"Client nodes:\s+(.*)\n", report).group(1)
    per_address = Counter(alive_ray_nodes(cluster).values())
    assert clients == ", ".join(f"{ip} x{n}" for ip, n in sorted(per_address.items())), clients


def test_a_node_that_dies_fails_only_its_requests_and_its_replica_returns(cluster, served, reference):
    info = served.info()
    worker_node = next(n for n, ip in alive_ray_nodes(cluster).items() if n not in head_node_ids(cluster))
    doomed = next(r.index for r in info.replicas if r.node_id == worker_node)
    survivor = 1 - doomed
    batch = prompts(8, seed=11)

    async def run() -> tuple[dict, list, list, float | None]:
        async with AsyncGenerationClient(served.target) as client:
            streams = [client.generate(p, timeout_s=SERVE_TIMEOUT_S, **LONG) for p in batch]
            firsts = [await anext(s) for s in streams]  # every request is running: a chunk came back

            async def rest_of(first, stream):
                tokens = list(first.token_ids)
                try:
                    async for item in stream:
                        if isinstance(item, Chunk):
                            tokens += item.token_ids
                    return tokens, "OK"
                except grpc.aio.AioRpcError as e:
                    return tokens, e.code().name

            in_flight = {r.index: r.in_flight for r in (await client.model_info()).replicas}
            finishing = [asyncio.ensure_future(rest_of(f, s)) for f, s in zip(firsts, streams, strict=True)]
            killed = time.monotonic()
            await asyncio.to_thread(cluster.kill_node, 1)
            # the gateway stops routing to the replica after a second of silence (replica_down_after_s's
            # help), within two with the poll's interval on a loaded machine; requests sent from then on succeed
            probes, stopped_routing = [], None
            while time.monotonic() - killed < 3.0:
                probes.append((time.monotonic() - killed, asyncio.ensure_future(collect_ok(client, [5, 6, 7]))))
                state = {r.index: r.state for r in (await client.model_info()).replicas}
                if stopped_routing is None and state[doomed] != "up":
                    stopped_routing = time.monotonic() - killed
                await asyncio.sleep(0.1)
            probed = [(sent, await probe) for sent, probe in probes]
            return in_flight, await asyncio.gather(*finishing), probed, stopped_routing

    in_flight, finished, probes, stopped_routing = asyncio.run(run())
    assert in_flight[doomed] > 0 and in_flight[survivor] > 0, in_flight
    statuses = [status for _, status in finished]
    # exactly the doomed replica's requests fail, with UNAVAILABLE; the others run to max_tokens
    assert sorted(statuses) == sorted(["UNAVAILABLE"] * in_flight[doomed] + ["OK"] * in_flight[survivor])
    expected = reference.generate(batch, SamplingParams(**LONG), use_tqdm=False)
    for (tokens, status), e in zip(finished, expected, strict=True):
        want = e.outputs[0].token_ids
        assert tokens == (want if status == "OK" else want[: len(tokens)])
    assert stopped_routing is not None and stopped_routing < 2.0, stopped_routing
    # one the dying replica took before (its node's processes die one by one) is lost with it
    assert all(status == "OK" or status.startswith(f"UNAVAILABLE: replica {doomed} ") for _, status in probes), probes
    assert all(status == "OK" for sent, status in probes if sent >= stopped_routing), probes

    # the node comes back (a new Ray node on the same address): the replica is placed there again
    cluster.start_node(1)
    deadline = time.monotonic() + 90
    while True:
        replicas = {r.index: r for r in served.info().replicas}
        nodes = alive_ray_nodes(cluster)
        back = replicas[doomed]
        if back.state == "up" and back.node_id in nodes and back.node_id != worker_node:
            break
        assert time.monotonic() < deadline, f"replica {doomed} did not come back: {replicas[doomed]}"
        time.sleep(0.5)
    assert sorted(replica_nodes(served.info()).values()) == sorted(nodes)  # one per node again
    before = {r.index: r.routed for r in served.info().replicas}
    again = prompts(8, seed=5)
    results = asyncio.run(stream_all(served.target, [(p, GREEDY) for p in again]))
    expected = reference.generate(again, SamplingParams(**GREEDY), use_tqdm=False)
    assert [tokens for tokens, _, _ in results] == [e.outputs[0].token_ids for e in expected]
    assert all(r.routed > before[r.index] for r in served.info().replicas)  # both replicas serve again


def test_job_stop_leaves_nothing_behind(cluster, served):
    stop = ray_cli(cluster, "job", "stop", "--address", cluster.dashboard, served.job)
    served.stopped = True
    assert stop.returncode == 0, stop.stderr
    assert job_status(cluster, served.job) == "STOPPED"
    deadline = time.monotonic() + 30
    while True:
        actors = rest(cluster, "/api/v0/actors?limit=1000")["data"]["result"]["result"]
        alive = [a["class_name"] for a in actors if a["state"] != "DEAD" and a["class_name"] in ("Driver", "Worker")]
        groups = rest(cluster, "/api/v0/placement_groups?limit=1000")["data"]["result"]["result"]
        kept = [g["placement_group_id"] for g in groups if g["state"] != "REMOVED"]
        if not alive and not kept:
            break
        assert time.monotonic() < deadline, f"left behind: actors {alive}, placement groups {kept}"
        time.sleep(0.5)
    with pytest.raises(grpc.RpcError) as error:
        served.info()
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE  # nothing listens on the gateway's port
    if isinstance(cluster, NetnsCluster):
        assert cluster.processes_matching("ray::Driver", "ray::Worker", "deltaserve serve") == []


async def collect_ok(client: AsyncGenerationClient, prompt: list[int]) -> str:
    """ "OK" when the request gets its 4 tokens, else what went wrong."""
    try:
        items = [item async for item in client.generate(prompt, timeout_s=30, max_tokens=4, ignore_eos=True)]
    except grpc.aio.AioRpcError as e:
        return f"{e.code().name}: {e.details()}"
    return "OK" if isinstance(items[-1], Final) and items[-1].completion_tokens == 4 else f"{items[-1]}"


def head_node_ids(cluster) -> set[str]:
    head_ip = cluster.nodes[0].ip
    nodes = alive_ray_nodes(cluster)
    if cluster.kind == "local":
        return {cluster.nodes[0].handle.node_id}
    return {n for n, ip in nodes.items() if ip == head_ip}
