"""Starting an engine: every setting that can be checked is checked before anything starts (no Ray,
no weights), each failure a ValueError whose one-line message names the setting; then the model's
config, the executor the settings ask for, and the EngineCore over it.
"""

from __future__ import annotations

import errno
import os
import re
import socket
import sys
from pathlib import Path

from deltaserve.cluster.config import EngineConfig
from deltaserve.cluster.core.engine import EngineCore
from deltaserve.cluster.core.sampling_params import generation_defaults
from deltaserve.cluster.executors import make_executor, runs_in_process
from deltaserve.cluster.executors.base import Executor
from deltaserve.layers.config import ModelConfig
from deltaserve.layers.parallel import ParallelLayout, validate_layout
from deltaserve.workers.config import short

# owner/name, as Hugging Face Hub ids are written
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_ERROR_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Failure|Exit|Interrupt)\b.*: ")


def load_model_config(model: str | None) -> ModelConfig:
    """The checkpoint's config, or a ValueError naming `model` (a missing folder, no config.json, a Hub
    id that was not downloaded, a config deltaserve cannot serve)."""
    if model is None:
        raise ValueError("model: a checkpoint directory is required")
    path = Path(model)
    if not path.exists():
        if _HUB_ID.match(model) and len(model) <= 100:
            raise ValueError(
                f"model: {model!r} is not a local directory; Hugging Face Hub ids need a local download first"
                f" (e.g. `hf download {model} --local-dir DIR`, then the model DIR)"
            )
        raise ValueError(f"model: {short(model, 80)} does not exist")
    if not path.is_dir():
        raise ValueError(f"model: {short(model, 80)} is not a directory")
    if not (path / "config.json").is_file():
        raise ValueError(f"model: {short(model, 80)} has no config.json")
    try:
        return ModelConfig.from_pretrained(path)
    except ValueError as e:
        raise ValueError(f"model: {short(model, 80)}: {e}") from None


def check_layout(config: EngineConfig, model_config: ModelConfig) -> None:
    """Tensor and expert parallelism against the model's sizes."""
    parallel = config.parallel
    try:
        validate_layout(model_config, ParallelLayout(0, parallel.tensor_parallel_size, parallel.enable_expert_parallel))
    except ValueError as e:
        setting = "enable_expert_parallel" if parallel.enable_expert_parallel else "tensor_parallel_size"
        raise type(e)(f"{setting}: the model cannot be split so: {e}") from None


def check_lora(config: EngineConfig, model_config: ModelConfig) -> None:
    """LoRA adapters run on the qwen3_next / qwen3_5 families' layers, without speculative decoding
    (the MTP head and the verify graphs do not apply adapters yet)."""
    if not config.lora.enable_lora:
        return
    if model_config.family == "qwen4_exp":
        raise ValueError("enable_lora: LoRA adapters are not served for qwen4_exp checkpoints yet")
    if config.runner.num_speculative_tokens:
        raise ValueError("enable_lora: not served together with speculative_config yet")


def check_speculative(config: EngineConfig, model_config: ModelConfig) -> None:
    """Speculative decoding with the MTP head needs a checkpoint that declares exactly one MTP layer
    (its weights are checked when they load)."""
    if not config.runner.num_speculative_tokens:
        return
    if model_config.family == "qwen4_exp":
        raise ValueError("speculative_config: the MTP head of qwen4_exp checkpoints is not supported")
    if model_config.num_mtp_layers != 1:
        declared = "none" if model_config.num_mtp_layers < 1 else f"{model_config.num_mtp_layers} layers"
        raise ValueError(
            f"speculative_config: method 'mtp' needs a checkpoint with one MTP layer; {short(config.load.model, 80)} "
            f"declares {declared} (config mtp_num_hidden_layers / num_nextn_predict_layers)"
        )


def runs_on_this_machine(config: EngineConfig, ray_address: str | None = None) -> bool:
    """Whether the ranks run on this machine: in this process, or in a Ray cluster started here (not
    one joined through `ray_address` / RAY_ADDRESS or an earlier `ray.init`)."""
    if runs_in_process(config) and config.data_parallel.data_parallel_size == 1:
        return True
    ray = sys.modules.get("ray")
    joined = ray is not None and ray.is_initialized()
    return not (joined or ray_address or os.environ.get("RAY_ADDRESS"))


def check_device(config: EngineConfig, ray_address: str | None = None) -> None:
    """A CUDA device asked for where the ranks would run on this machine must be there."""
    device = config.load.device
    if not device.startswith("cuda") or not runs_on_this_machine(config, ray_address):
        return
    import torch

    if not torch.cuda.is_available():
        build = "a CPU build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        raise ValueError(f"device: {device!r} needs a GPU, and this torch ({torch.__version__}, {build}) sees none")
    tp, dp = config.parallel.tensor_parallel_size, config.data_parallel.data_parallel_size
    if torch.cuda.device_count() < tp * dp:
        setting = "tensor_parallel_size" if dp == 1 else "data_parallel_size"
        raise ValueError(
            f"{setting}: {dp} replica(s) of {tp} rank(s) need {tp * dp} GPUs; this machine has "
            f"{torch.cuda.device_count()}"
        )


def check_port(host: str, port: int, name: str = "port") -> None:
    """A front door's port (`name`: the setting) is free (port 0 picks a free one)."""
    if port == 0:
        return
    if not 0 < port < 65536:
        raise ValueError(f"{name}: must be in [0, 65535], got {port}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ValueError(f"{name}: {port} on {host} is already in use") from None
            raise ValueError(f"host: cannot bind {short(host)}:{port}: {e.strerror}") from None


def check_startup(config: EngineConfig, ray_address: str | None = None) -> ModelConfig:
    """Everything about `config` that can be checked before anything starts; returns the model's config."""
    model_config = load_model_config(config.load.model)
    check_layout(config, model_config)
    check_lora(config, model_config)
    check_speculative(config, model_config)
    check_device(config, ray_address)
    sampling_defaults(config)
    return model_config


def sampling_defaults(config: EngineConfig) -> dict:
    """The sampling fields requests that leave them unset take (generation_config; ValueError naming it)."""
    serving = config.serving
    return generation_defaults(config.load.model, serving.generation_config, serving.override_generation_config)


def check_lora_modules(config: EngineConfig, modules: list[str]) -> list[tuple[str, str]]:
    """`--lora-modules NAME=PATH ...` parsed, each adapter checked against the model (a ValueError
    naming the flag, the adapter and its file or field); returns [(name, path)]."""
    if not modules:
        return []
    if not config.lora.enable_lora:
        raise ValueError("--lora-modules: needs --enable-lora")
    from deltaserve.cluster.core.lora import AdapterRegistry, LoRARequest

    registry = AdapterRegistry(config.lora, load_model_config(config.load.model))
    out = []
    for i, item in enumerate(modules):
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules: {short(item)} is not NAME=PATH")
        try:
            registry.add(LoRARequest(name, i + 1, path))
        except ValueError as e:
            raise ValueError(f"--lora-modules {short(name)}: {e}") from None
        out.append((name, path))
    return out


def build_engine(
    config: EngineConfig,
    *,
    model_config: ModelConfig | None = None,
    executor: Executor | None = None,
    output_mode: str = "cumulative",
) -> EngineCore:
    """An EngineCore for `config`, checked first; `model_config` stands in for the checkpoint's, and
    `executor` for the one `config.executor` asks for."""
    if model_config is None:
        model_config = load_model_config(config.load.model)
    check_layout(config, model_config)
    check_lora(config, model_config)
    check_speculative(config, model_config)
    if executor is None:
        check_device(config)
        executor = make_executor(config, model_config)
    return EngineCore(config, model_config, executor, output_mode=output_mode)


def one_line(error: BaseException) -> str:
    """The innermost cause of `error` as one line. Ray carries a failure inside an actor as the text of
    its traceback, so the last `SomeError: message` line of that text is taken."""
    while isinstance(getattr(error, "cause", None), BaseException):
        error = error.cause
    while error.__cause__ is not None:
        error = error.__cause__
    lines = [line.strip() for line in _ANSI.sub("", str(error)).splitlines() if line.strip()]
    found = next((line for line in reversed(lines) if _ERROR_LINE.match(line)), None)
    if found is None:
        found = f"{type(error).__name__}: {lines[0] if lines else ''}"
    return found if len(found) <= 400 else found[:397] + "..."
