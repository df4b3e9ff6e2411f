"""Start-up as a user meets it: `deltaserve --help` and the thin `generate` client start fast without
torch; a setting that cannot work is one line naming it, exit status 2, before Ray starts; a failure
inside an actor at start-up is its cause in one line."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deltaserve.cli import main
from deltaserve.cluster.entrypoints.startup import one_line

# the console script users run, beside this interpreter (the project is installed in its environment)
DELTASERVE = str(Path(sys.executable).with_name("deltaserve"))


def run(*argv: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "RAY_ADDRESS": "", **env}
    return subprocess.run([DELTASERVE, *argv], capture_output=True, text=True, timeout=timeout, env=environ)


def imported_modules(stderr: str) -> set[str]:
    """Module names from `python -X importtime` output."""
    return {line.rsplit("|", 1)[-1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


def test_help_is_fast_and_imports_no_torch():
    started = time.perf_counter()
    done = run("--help", PYTHONPROFILEIMPORTTIME="1")
    elapsed = time.perf_counter() - started
    assert done.returncode == 0 and "serve" in done.stdout and "bench" in done.stdout
    modules = imported_modules(done.stderr)
    assert "deltaserve.cli" in modules and not {m for m in modules if m.split(".")[0] in ("torch", "ray")}
    assert elapsed < 2.0, elapsed  # about 0.1 s on an idle core; the bound leaves room for a busy machine


def test_generate_imports_no_torch_and_reports_an_unreachable_server_in_a_line():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = run("generate", "hi", "--target", f"127.0.0.1:{port}", timeout=60, PYTHONPROFILEIMPORTTIME="1")
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    assert len(errors) == 1 and errors[0].startswith("error: UNAVAILABLE"), errors
    assert not {m for m in imported_modules(done.stderr) if m.split(".")[0] == "torch"}


def test_missing_model_is_one_line_before_ray(tmp_path):
    started = time.perf_counter()
    done = run("serve", "--model", str(tmp_path / "nope"))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"deltaserve serve: model: '{tmp_path / 'nope'}' does not exist"]
    assert time.perf_counter() - started < 30  # no Ray start, no 35 s wait


def test_cuda_without_a_gpu_is_one_line_before_ray(tiny_checkpoints):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this torch sees a GPU")
    done = run("serve", "--model", str(tiny_checkpoints["qwen3_next"][0]), "--device", "cuda", "--port", "0")
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("deltaserve serve: device: 'cuda' needs a GPU, and this torch")


def serve_error(capsys, *argv: str) -> str:
    """Run `deltaserve serve ...` in-process; it must refuse with exit status 2 and one line."""
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_settings_that_cannot_work_are_refused_naming_them(capsys, tmp_path, tiny_checkpoints):
    model = str(tiny_checkpoints["qwen3_next"][0])  # 3 GDN key heads
    line = serve_error(capsys, "--model", "Qwen/Qwen3.5-35B-A3B")
    assert line.startswith("deltaserve serve: model: 'Qwen/Qwen3.5-35B-A3B' is not a local directory")
    assert "Hub ids need a local download" in line
    assert serve_error(capsys, "--model", str(tmp_path)) == f"deltaserve serve: model: '{tmp_path}' has no config.json"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert serve_error(capsys, "--model", str(tmp_path)).startswith(f"deltaserve serve: model: '{tmp_path}': ")
    line = serve_error(capsys, "--model", model, "--tp", "2")
    assert line.startswith("deltaserve serve: tensor_parallel_size: the model cannot be split so: linear_num_key_heads")
    line = serve_error(capsys, "--model", model, "--max-num-seqs", "0")
    assert line == "deltaserve serve: max_num_seqs: must be >= 1, got 0"
    line = serve_error(capsys, "--model", model, "--backend", "local", "--tp", "2")
    assert line.startswith("deltaserve serve: backend: 'local' runs one rank")
    line = serve_error(capsys, "--model", model, "--backend", "local", "--dp", "2")
    assert line == "deltaserve serve: backend: 'local' runs one engine in this process; data_parallel_size needs 'ray'"
    line = serve_error(capsys, "--model", model, "--data-parallel-size", "0")
    assert line == "deltaserve serve: data_parallel_size: must be >= 1, got 0"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = serve_error(capsys, "--model", model, "--host", "127.0.0.1", "--port", str(port), "--backend", "local")
        assert line == f"deltaserve serve: port: {port} on 127.0.0.1 is already in use"
    import torch

    if not torch.cuda.is_available():
        line = serve_error(capsys, "--model", model, "--device", "cuda", "--backend", "local")
        assert line.startswith("deltaserve serve: device: 'cuda' needs a GPU")


def test_one_line_takes_the_innermost_error_of_a_ray_traceback():
    class ActorDied(Exception):
        pass

    text = (
        "The actor died because of an error raised in its creation task, \x1b[36mray::Driver.__init__()\x1b[39m\n"
        '  File "driver.py", line 3, in __init__\n    raise ...\n'
        "ray.exceptions.ActorDiedError: The actor died because of an error raised in its creation task\n"
        '  File "loader.py", line 9, in checkpoint_files\n'
        "deltaserve.layers.loader.CheckpointError: no *.safetensors files in /m\n"
    )
    assert one_line(ActorDied(text)) == "deltaserve.layers.loader.CheckpointError: no *.safetensors files in /m"
    assert one_line(RuntimeError("plain")) == "RuntimeError: plain"


def test_local_ray_cluster_starts_without_the_dashboard(monkeypatch):
    import ray

    from deltaserve.cluster.executors.ray import connect_ray

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    connect_ray()
    connect_ray("auto")
    assert calls[0]["address"] == "local" and calls[0]["include_dashboard"] is False
    assert calls[1]["address"] == "auto"


def test_bench_serve_help_example_keeps_its_line_continuations():
    from deltaserve.bench import serve

    assert "--output-len 128 \\\n        --max-concurrency 64" in serve.__doc__


@pytest.mark.ray
def test_failure_inside_an_actor_at_start_up_is_its_cause_in_one_line(tmp_path, tiny_checkpoints):
    """A checkpoint with a config but no weights passes the checks before Ray; the driver actor then
    fails loading it, and serve reports that cause in one line (exit status 1)."""
    (tmp_path / "config.json").write_text((Path(tiny_checkpoints["qwen3_next"][0]) / "config.json").read_text())
    done = run(
        "serve", "--model", str(tmp_path), "--port", "0", "--http-port", "0", timeout=240, RAY_USAGE_STATS_ENABLED="0"
    )
    assert done.returncode == 1, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("deltaserve serve: start-up failed: ") and "no *.safetensors files in" in last, last
