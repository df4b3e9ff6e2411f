"""The server's life around failures: while a dead worker group is replaced, health stays SERVING and
new requests wait in the queue, then are served with the right tokens (under load); a server whose
driver actor died stops on SIGTERM with one line and exit status 1, no traceback."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from serving_harness import LoopThread, Served, descendant_pids, start_served, stop_served, wait_for_idle_pool

from deltaserve import LLM, SamplingParams
from deltaserve.cluster.config import EngineConfig
from deltaserve.cluster.entrypoints.client import AsyncGenerationClient, Final, GenerationClient

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

GREEDY = dict(temperature=0, max_tokens=8, ignore_eos=True)
DELTASERVE = str(Path(sys.executable).with_name("deltaserve"))

# a line Ray forwards from one of its processes: "(Worker pid=123)" after an optional colour code
RAY_FORWARDED = re.compile(r"^(\x1b\[[0-9;]*m)?\((\w+) pid=\d+")


def prompt(i: int) -> list[int]:
    return [3 + i % 300, 7, 11 + i % 50]


def test_worker_group_replaced_under_load(ray_session, tiny_checkpoints, report):
    model = str(tiny_checkpoints["qwen3_next"][0])
    reference = LLM(model, max_model_len=64)
    expected = {
        i: out.outputs[0].token_ids
        for i, out in enumerate(
            reference.generate([prompt(i) for i in range(400)], SamplingParams(**GREEDY), use_tqdm=False)
        )
    }
    reference.shutdown()
    aio = LoopThread()
    served = start_served(aio, EngineConfig.from_kwargs(model=model, max_model_len=64, executor="ray"))
    engine = served.engine._replicas[0].loop_engine.engine
    old = engine.executor.workers[0]
    try:
        results = asyncio.run(load_across_a_worker_death(served, ray_session, old))
        assert engine.executor.workers[0] is not old  # the group was replaced
        wait_for_idle_pool(served, within_s=10)
    finally:
        stop_served(served)
        aio.close()
    failed_at, health, outcomes = results
    assert failed_at is not None, "no request saw the worker die"
    assert set(health) == {"SERVING"}, health
    after = [(i, sent, got) for i, sent, got in outcomes if sent > failed_at]
    assert len(after) >= 10
    for i, _, got in after:  # queued during the replacement, then served with the right tokens
        assert got == expected[i], (i, got)
    before = [got for _, sent, got in outcomes if sent <= failed_at]
    assert all(got == "UNAVAILABLE" or isinstance(got, list) for got in before)
    report(
        f"worker replaced under load: {len(outcomes)} requests, {sum(g == 'UNAVAILABLE' for g in before)} in flight"
        f" failed UNAVAILABLE, {len(after)} sent after the failure all served; health {len(health)}x SERVING"
    )


async def load_across_a_worker_death(served: Served, ray, victim):
    """16 clients send greedy requests back to back; one second in, the worker actor is killed; they go on
    until 2 s after the first request sent after the failure was served (the new group is up: however
    long its start takes on a busy machine), at most 60 s in all. Returns (time of the first failure,
    health answers, outcomes)."""
    outcomes, health = [], []
    failed_at = None
    stop_at = time.monotonic() + 60
    async with AsyncGenerationClient(served.target) as client:

        async def sender(k: int) -> None:
            nonlocal failed_at
            i = k
            while time.monotonic() < stop_at:
                sent = time.monotonic()
                try:
                    items = [item async for item in client.generate(prompt(i), timeout_s=60, **GREEDY)]
                    got = [t for item in items if not isinstance(item, Final) for t in item.token_ids]
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.UNAVAILABLE, e.details()
                    got = "UNAVAILABLE"
                    failed_at = failed_at or time.monotonic()
                outcomes.append((i, sent, got))
                i += 16

        async def watcher() -> None:
            nonlocal stop_at
            await asyncio.sleep(1.0)
            ray.kill(victim)
            while failed_at is None:
                await asyncio.sleep(0.01)
            recovered = False
            while time.monotonic() < stop_at:
                health.append(await client.health(timeout_s=5))
                if not recovered and any(sent > failed_at and got != "UNAVAILABLE" for _, sent, got in outcomes):
                    recovered = True
                    stop_at = min(stop_at, time.monotonic() + 2)
                await asyncio.sleep(0.05)

        await asyncio.gather(watcher(), *(sender(k) for k in range(16)))
    return failed_at, health, outcomes


def driver_pid(root: int) -> int | None:
    for pid in descendant_pids(root):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().startswith(b"ray::Driver"):
                    return pid
        except OSError:
            continue
    return None


def test_sigterm_after_the_driver_died_is_one_line(tiny_checkpoints, tmp_path):
    model = str(tiny_checkpoints["qwen3_next"][0])
    port_file = tmp_path / "port"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    serve = subprocess.Popen(
        [DELTASERVE, "serve", "--model", model, "--device", "cpu", "--port", "0", "--http-port", "0"]
        + ["--port-file", str(port_file)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (port_file.exists() and port_file.read_text()):
            assert serve.poll() is None, serve.communicate()
            assert time.monotonic() < deadline, "serve did not start in 120 s"
            time.sleep(0.2)
        target = f"127.0.0.1:{port_file.read_text()}"
        pid = driver_pid(serve.pid)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        with GenerationClient(target) as client:
            deadline = time.monotonic() + 30
            while client.health(timeout_s=5) != "NOT_SERVING":
                assert time.monotonic() < deadline
                time.sleep(0.1)
        serve.send_signal(signal.SIGTERM)
        out, err = serve.communicate(timeout=60)
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()
    assert serve.returncode == 1, err
    # Ray forwards its processes' output prefixed "(Worker pid=...)": a worker SIGTERMed by Ray as its
    # owner died may print Ray's own "Exception ignored" traceback there; this process prints none
    here = [line for line in err.splitlines() if not RAY_FORWARDED.match(line)]
    assert not any("Traceback" in line for line in here), err
    ours = [line for line in err.splitlines() if line.startswith("deltaserve")]
    assert len(ours) == 1, err
    assert ours[0].startswith("deltaserve: stopped; the engine had failed before: replica 0 on node "), err
    assert "failed: its actor is gone (ActorDiedError" in ours[0], err
