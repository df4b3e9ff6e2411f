"""Weights: safetensors checkpoints (one file or sharded with an index) -> a rank's shard of the
parameters, or a seeded random fill of the real shapes (`load_format="random"`).

Every parameter is read through the layers' `checkpoint_tensors()` list, so a rank reads only the
slices it owns, and a tensor that is missing or has the wrong shape is an error naming it. Composite
checkpoints (`model.language_model.*`) map onto the text names; vision tensors are skipped; `mtp.*`
tensors load into the MTP head when the model is built with it (speculative decoding), and are
skipped otherwise.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from .base import CheckpointTensor, LazyTensor
from .config import ModelConfig
from .model import HybridModel
from .mtp import MtpHead
from .parallel import ParallelLayout
from .qwen4_exp import Qwen4ExpModel

log = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "random")
_VISION_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.", "vision_tower.", "model.merger.")


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: the message names the tensor."""


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def canonical_name(name: str) -> str | None:
    """The text-model name for a checkpoint tensor; None for tensors the text model never uses."""
    if name.startswith(_VISION_PREFIXES):
        return None
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model.") :]
    if name.startswith("language_model."):  # older composite layouts
        return name[len("language_model.") :]
    return name


def checkpoint_files(model_dir: str | Path) -> dict[str, Path]:
    """tensor name -> the safetensors file that holds it."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / fname for name, fname in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {model_dir}")
    out: dict[str, Path] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            out.update({name: path for name in f.keys()})  # noqa: SIM118 - safe_open has no __iter__
    return out


def build_model(
    config: ModelConfig,
    *,
    layout: ParallelLayout | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    mtp: bool = False,
) -> HybridModel:
    """The model with uninitialised parameters allocated directly in `dtype` on `device`; with `mtp`,
    its MTP head too (an error naming the config field when the checkpoint declares none)."""
    if mtp and (config.num_mtp_layers < 1 or config.family == "qwen4_exp"):
        raise CheckpointError(
            "speculative_config method 'mtp' needs a checkpoint with an MTP head of a qwen3_next / qwen3_5 family; "
            f"this {config.family} config declares {config.num_mtp_layers} (mtp_num_hidden_layers / "
            "num_nextn_predict_layers)"
        )
    cls = Qwen4ExpModel if config.family == "qwen4_exp" else HybridModel
    with torch.device(device), _default_dtype(dtype):
        model = cls(config, layout)
        if mtp:
            model.mtp = MtpHead(config, model.layout)
    return model.eval()


def load_model(
    model_dir: str | Path | None,
    *,
    config: ModelConfig | None = None,
    layout: ParallelLayout | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    load_format: str = "auto",
    seed: int = 0,
    mtp: bool = False,
) -> HybridModel:
    """Build the model (with `mtp`: and its MTP head) and fill this rank's shard of every parameter."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    if config is None:
        if model_dir is None:
            raise ValueError("load_model needs model_dir or config")
        config = ModelConfig.from_pretrained(model_dir)
    started = time.perf_counter()
    model = build_model(config, layout=layout, dtype=dtype, device=device, mtp=mtp)
    entries = model.checkpoint_tensors()
    if load_format == "random":
        fill_random(entries, seed=seed, dtype=dtype, device=device)
    else:
        if model_dir is None:
            raise ValueError(f"load_format={load_format!r} needs a model directory")
        load_safetensors(model, entries, model_dir, dtype=dtype, device=device)
    log.info("loaded %s (%s) in %.1fs", model_dir or config.model_type, load_format, time.perf_counter() - started)
    return model


def _required_targets(entries: list[CheckpointTensor]) -> dict[str, str]:
    """target -> the tensor name to report when it is missing."""
    return {t: e.name for e in entries if e.load is not None and not e.alternative for t in e.targets}


def load_safetensors(
    model: HybridModel, entries: list[CheckpointTensor], model_dir: str | Path, *, dtype: torch.dtype, device
) -> None:
    by_name = {e.name: e for e in entries}
    files = checkpoint_files(model_dir)
    covered: set[str] = set()
    unexpected: list[str] = []
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        by_file.setdefault(path, []).append(name)
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for raw_name in names:
                name = canonical_name(raw_name)
                if name is None:
                    continue
                if name.startswith("mtp.") and model.mtp is None:
                    continue  # the MTP head is built only for speculative decoding
                entry = by_name.get(name)
                if entry is None:
                    unexpected.append(raw_name)
                    continue
                if entry.load is None:
                    continue  # another rank's tensor
                sliced = f.get_slice(raw_name)
                shape = tuple(sliced.get_shape())
                if shape != entry.shape:
                    raise CheckpointError(f"checkpoint tensor '{raw_name}' has shape {shape}, expected {entry.shape}")
                entry.load(LazyTensor(raw_name, shape, _slice_reader(sliced)))
                covered.update(entry.targets)
    if model.mtp is not None and not any((canonical_name(n) or "").startswith("mtp.") for n in files):
        raise CheckpointError(
            f"speculative_config method 'mtp' needs MTP weights (mtp.*); checkpoint {model_dir} has none"
        )
    missing = [name for target, name in _required_targets(entries).items() if target not in covered]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(
            f"checkpoint {model_dir} is missing tensor '{missing[0]}'"
            + (f"; also missing: {', '.join(missing[1:5])}{more}" if len(missing) > 1 else "")
        )
    if unexpected:
        log.warning("ignored %d checkpoint tensors the model does not use, e.g. %s", len(unexpected), unexpected[:3])


def _slice_reader(sliced):
    def read(index: tuple) -> torch.Tensor:
        return sliced[index] if index else sliced[:]

    return read


def fill_random(entries: list[CheckpointTensor], *, seed: int, dtype: torch.dtype, device) -> None:
    """Fill every target from a per-tensor seed: the same weights whatever the rank layout."""
    covered: set[str] = set()
    for entry in entries:
        if entry.load is None or entry.init == "computed" or covered.issuperset(entry.targets):
            continue  # "computed": the parameter holds its value from the config already
        generator = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(entry.name.encode()))
        full = _random_tensor(entry.shape, entry.init, generator, dtype, device)
        entry.load(LazyTensor(entry.name, entry.shape, lambda index, full=full: full[index] if index else full))
        covered.update(entry.targets)


def _random_tensor(shape, init: str, generator: torch.Generator, dtype: torch.dtype, device) -> torch.Tensor:
    if init == "zeros":
        return torch.zeros(shape, dtype=dtype, device=device)
    if init == "ones":
        return torch.ones(shape, dtype=dtype, device=device)
    if init == "a_log":  # A in [1, 16): decays like a trained GDN's
        a = torch.rand(shape, generator=generator, device=device, dtype=torch.float32) * 15 + 1
        return a.log().to(dtype)
    if init == "normal":
        return (torch.randn(shape, generator=generator, device=device, dtype=torch.float32) * 0.02).to(dtype)
    raise ValueError(f"unknown init {init!r}")
