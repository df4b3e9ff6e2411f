"""The README's recipes as a user types them, on a fresh clone: the commands are read from README.md
itself, run by bash in the clone with a plain PATH (no venv on it: the venv is reached the way the
README says). The project's venv is reused (a `.venv` link in the clone) so that no install runs.

What is substituted, and only that: the placeholders (`/path/to/checkpoint`: a tiny TP-2 checkpoint,
`<head-ip>`, `<submission-id>`: the id `ray job submit` printed) and the fixed ports (8265, 50051, 8000,
and the head's own ports: this suite's other Ray instance holds Ray's defaults); `ray start` gets
`--block` so that the test can stop exactly that cluster; commands that follow a log or serve run in
the background, as a user runs them in a second shell."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from serving_harness import free_port, own_head_ports
from tiny_models import TP2_OVERRIDES, save_tiny, save_tiny_chat

from deltaserve.cluster.entrypoints.client import GenerationClient

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(sys.prefix) if sys.prefix != sys.base_prefix else None  # the venv this suite runs in
PLAIN_PATH = "/usr/local/bin:/usr/bin:/bin"


def readme_block(heading: str) -> list[str]:
    """The commands of the first indented block after `heading` in README.md: continuation lines
    joined, trailing comments dropped."""
    text = (ROOT / "README.md").read_text()
    after = text[text.index(heading) :]
    block = re.search(r"\n\n((?: {4}.*\n)+)", after).group(1)
    commands, current = [], ""
    for line in block.splitlines():
        line = line[4:]
        current += line.rstrip("\\").rstrip() + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            commands.append(re.sub(r"\s+#.*$", "", current).strip())
            current = ""
    return commands


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    if VENV is None:
        pytest.skip("the suite runs outside a venv: nothing to reuse in the clone")
    path = tmp_path_factory.mktemp("fresh") / "deltaserve"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(path)], check=True, timeout=60)
    (path / ".venv").symlink_to(VENV)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """A tiny TP-2 checkpoint with a chat template (the README's chat recipe renders through it)."""
    path = tmp_path_factory.mktemp("tp2")
    save_tiny("qwen3_5_moe", path, **TP2_OVERRIDES["qwen3_5_moe"])
    return str(save_tiny_chat(path, tmp_path_factory.mktemp("tp2-chat")))


def user_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "RAY_ADDRESS", "PYTHONPATH")}
    return {**env, "PATH": PLAIN_PATH, "RAY_USAGE_STATS_ENABLED": "0"}


def shell(clone: Path, prefix: list[str], command: str, **popen) -> subprocess.Popen:
    """`command` in bash in the clone, after the recipe's `source` / `export` lines (a user's shell)."""
    script = "; ".join([*prefix, command])
    return subprocess.Popen(
        ["bash", "-c", script], cwd=clone, env=user_env(), text=True, start_new_session=True, **popen
    )


def start_head(
    clone: Path, prefix: list[str], start: str, log: Path, attempts: int = 3
) -> tuple[subprocess.Popen, int]:
    """The recipe's `ray start --head` on free ports, up to `attempts` times: a port found free can be
    taken before the head binds it (the suite's other Ray instance binds ports all the while).
    Returns the head (blocking) and its dashboard port once `ray job list` answers there."""
    for attempt in range(attempts):
        dashboard, gcs = free_port(), free_port()
        own_ports = " ".join(own_head_ports())
        with open(log, "w") as f:
            head = shell(
                clone,
                prefix,
                f"{start} --block --port={gcs} --dashboard-port={dashboard} {own_ports}",
                stdout=f,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 60
        list_jobs = f"ray job list --address http://127.0.0.1:{dashboard}"
        while finish(shell(clone, prefix, list_jobs, stdout=subprocess.PIPE, stderr=subprocess.PIPE), 60)[0]:
            if head.poll() is not None or time.monotonic() > deadline:
                break
            time.sleep(1)
        else:
            return head, dashboard
        stop_group(head, wait_s=5)
        if attempt == attempts - 1:
            raise AssertionError(f"the Ray head did not come up: {log.read_text()[-3000:]}")
    raise AssertionError("unreachable")


def finish(process: subprocess.Popen, timeout: float) -> tuple[int, str, str]:
    out, err = process.communicate(timeout=timeout)
    return process.returncode, out or "", err or ""


def stop_group(process: subprocess.Popen, sig=signal.SIGTERM, wait_s: float = 10) -> None:
    if process.poll() is None:
        os.killpg(process.pid, sig)
        try:
            process.wait(wait_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def wait_serving(target: str, process: subprocess.Popen, what: str, within_s: float = 90) -> None:
    deadline = time.monotonic() + within_s
    with GenerationClient(target) as client:
        while True:
            assert process.poll() is None, f"{what} exited: {process.communicate()}"
            try:
                if client.health(timeout_s=1) == "SERVING":
                    return
            except Exception:
                pass
            assert time.monotonic() < deadline, f"{what} did not serve in {within_s} s"
            time.sleep(0.3)


def test_the_two_commands_exist_as_written(clone):
    assert readme_block("## The two commands") == ["scripts/demo"]
    assert readme_block("Run the tests") == ["scripts/test"]
    for name, runs in (("demo", ".venv/bin/deltaserve demo"), ("test", ".venv/bin/python -m pytest")):
        script = clone / "scripts" / name
        assert os.access(script, os.X_OK)
        body = script.read_text()
        assert body.startswith("#!/usr/bin/env bash") and "scripts/setup-env" in body and runs in body
    assert os.access(clone / "scripts" / "setup-env", os.X_OK)


def test_serve_and_generate_as_written(clone, checkpoint):
    serve, generate, chat = readme_block("Serve: one engine")
    port, http_port = str(free_port()), str(free_port())
    serve = serve.replace("/path/to/checkpoint", checkpoint).replace("50051", port).replace("8000", http_port)
    server = shell(clone, [], serve, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_serving(f"127.0.0.1:{port}", server, "serve")
        for command, summary in ((generate, "+ 32 completion tokens"), (chat, "completion tokens")):
            command = command.replace("50051", port)
            rc, out, err = finish(shell(clone, [], command, stdout=subprocess.PIPE, stderr=subprocess.PIPE), 60)
            assert rc == 0 and summary in err, (command, rc, out, err)
        os.killpg(server.pid, signal.SIGTERM)
        rc, out, err = finish(server, 60)
        assert rc == 0 and "deltaserve: stopped" in out, (rc, out, err)
    finally:
        stop_group(server, signal.SIGKILL)


def assert_tokens_of_llm_generate(target: str, checkpoint: str) -> None:
    """A greedy request to the served model gives LLM.generate's tokens (one rank, in this process)."""
    from deltaserve import LLM, SamplingParams
    from deltaserve.cluster.entrypoints.client import Final

    params = dict(max_tokens=6, temperature=0.0, ignore_eos=True)
    with GenerationClient(target) as client:
        items = list(client.generate([5, 6, 7, 8, 9], **params))
    tokens = [t for item in items if not isinstance(item, Final) for t in item.token_ids]
    (reference,) = LLM(checkpoint).generate([[5, 6, 7, 8, 9]], SamplingParams(**params), use_tqdm=False)
    assert tokens == reference.outputs[0].token_ids
    assert isinstance(items[-1], Final) and items[-1].finish_reason == "length"


def test_ray_job_submit_as_written(clone, checkpoint, tmp_path):
    lines = readme_block("### Under `ray job submit`")
    prefix = [line for line in lines if line.split()[0] in ("source", "export")]
    start, submit, generate, stop = [line for line in lines if line not in prefix]
    assert start.startswith("ray start --head") and submit.startswith("ray job submit")
    port = str(free_port())
    head, dashboard = start_head(clone, prefix, start, tmp_path / "head.log")
    job = None
    try:
        submit = (
            submit.replace("8265", str(dashboard))
            .replace("/path/to/checkpoint", checkpoint)
            .replace("50051", port)
            .replace("8000", str(free_port()))
        )
        log = tmp_path / "submit.log"
        deadline = time.monotonic() + 60
        while True:  # the head answers `job list` before its job agent takes jobs
            with open(log, "w") as f:
                job = shell(clone, prefix, submit, stdout=f, stderr=subprocess.STDOUT)
            try:
                wait_serving(f"127.0.0.1:{port}", job, "the job", within_s=90)
                break
            except AssertionError:
                if "No available agent" not in log.read_text() or time.monotonic() > deadline:
                    raise AssertionError(log.read_text()[-3000:]) from None
                time.sleep(2)
        generate = generate.replace("<head-ip>", "127.0.0.1").replace("50051", port)
        rc, out, err = finish(shell(clone, prefix, generate, stdout=subprocess.PIPE, stderr=subprocess.PIPE), 60)
        assert rc == 0 and "completion tokens" in err, (rc, out, err)
        assert_tokens_of_llm_generate(f"127.0.0.1:{port}", checkpoint)  # the job's engine is the LLM's
        submission = re.search(r"Job '([^']+)' submitted successfully", log.read_text()).group(1)
        stop = stop.replace("8265", str(dashboard)).replace("<submission-id>", submission)
        rc, out, err = finish(shell(clone, prefix, stop, stdout=subprocess.PIPE, stderr=subprocess.PIPE), 60)
        assert rc == 0, (out, err)
        job.wait(60)  # submit, following the log, ends with the job
        assert "deltaserve: not found" not in log.read_text()
    finally:
        if job is not None:
            stop_group(job, signal.SIGKILL)
        stop_group(head, wait_s=5)
