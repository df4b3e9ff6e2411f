"""`ray job submit` against a local `ray start --head`: the entry point starts the driver, a worker
and the gateway on that cluster, and a gRPC client gets the tokens LLM.generate gives."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from serving_harness import free_port, own_head_ports

from deltaserve import LLM, SamplingParams
from deltaserve.cluster.entrypoints.client import Final, GenerationClient

pytestmark = [pytest.mark.ray, pytest.mark.slow]

BIN = Path(sys.executable).parent


@pytest.fixture
def ray_head(tmp_path):
    """A blocking `ray start --head` of its own ports; terminating it stops that cluster only."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    gcs, dashboard = free_port(), free_port()
    own_ports = own_head_ports()  # every port its own
    head = subprocess.Popen(
        [
            str(BIN / "ray"),
            "start",
            "--head",
            "--block",
            f"--port={gcs}",
            f"--dashboard-port={dashboard}",
            *own_ports,
            "--dashboard-host=127.0.0.1",
            "--num-cpus=4",
            "--include-dashboard=true",
            "--disable-usage-stats",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    address = f"http://127.0.0.1:{dashboard}"
    try:
        deadline = time.monotonic() + 60
        while (
            subprocess.run(
                [str(BIN / "ray"), "job", "list", "--address", address], env=env, capture_output=True
            ).returncode
            != 0
        ):
            assert head.poll() is None, "ray start exited"
            assert time.monotonic() < deadline, "the Ray head did not come up in 60 s"
            time.sleep(1)
        yield address, env
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(5)  # `ray start --block` has never finished its own shutdown in 30 s: the group is killed below
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)


def test_job_submit_serves_tokens(ray_head, tiny_checkpoints, tmp_path):
    address, env = ray_head
    model = str(tiny_checkpoints["qwen3_5_moe"][0])
    port_file = tmp_path / "port"
    job = "deltaserve-test-job"
    command = [
        str(BIN / "ray"),
        "job",
        "submit",
        "--address",
        address,
        "--submission-id",
        job,
        "--no-wait",
        "--",
        str(BIN / "deltaserve"),
        "serve",
        "--model",
        model,
        "--device",
        "cpu",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--port-file",
        str(port_file),
    ]
    deadline = time.monotonic() + 90
    while True:  # the head answers `job list` before its job agent is up: retry until it takes jobs
        submit = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
        if submit.returncode == 0 or "No available agent" not in submit.stderr or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert submit.returncode == 0, submit.stderr
    try:
        deadline = time.monotonic() + 90
        while not port_file.exists() or not port_file.read_text():
            status = subprocess.run(
                [str(BIN / "ray"), "job", "status", "--address", address, job], env=env, capture_output=True, text=True
            ).stdout
            assert "FAILED" not in status, status
            assert time.monotonic() < deadline, "the job did not start serving in 90 s"
            time.sleep(0.5)
        target = f"127.0.0.1:{port_file.read_text()}"
        params = dict(max_tokens=6, temperature=0.0, ignore_eos=True)
        with GenerationClient(target) as client:
            items = list(client.generate([5, 6, 7, 8, 9], **params))
        tokens = [t for item in items if not isinstance(item, Final) for t in item.token_ids]
        (reference,) = LLM(model).generate([[5, 6, 7, 8, 9]], SamplingParams(**params), use_tqdm=False)
        assert tokens == reference.outputs[0].token_ids
        assert isinstance(items[-1], Final) and items[-1].finish_reason == "length"
    finally:
        subprocess.run(
            [str(BIN / "ray"), "job", "stop", "--address", address, job], env=env, capture_output=True, timeout=60
        )
