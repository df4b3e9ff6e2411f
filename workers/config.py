"""The worker side of the engine's configuration: frozen dataclasses, one per concern.

Each field's default and help are written once, here (`setting`); `deltaserve.cluster.config` puts
these beside the driver's sections in one tree, `EngineConfig`, and derives the flat keyword
arguments (`LLM(**kwargs)`) and the command-line flags from the fields. A wrong value raises a
ValueError naming the field when the section is built, wherever the value came from. Nothing here
imports torch.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from deltaserve.layers.kernels.options import KernelOptions

DTYPES = ("auto", "float32", "bfloat16", "float16", "float64")  # float64: CPU reference runs
LOAD_FORMATS = ("auto", "safetensors", "random")
QUANTIZATIONS = (None, "fp8")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # fp8: e4m3, as vLLM's --kv-cache-dtype fp8


def setting(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    aliases: Sequence[str] = (),
    choices: Sequence[Any] | None = None,
    check: Callable[[Any], str | None] | None = None,
    default_factory: Callable[[], Any] | Any = dataclasses.MISSING,
    cli: bool = True,
    parse: Callable[[str], Any] | None = None,
) -> Any:
    """A configuration field: its default, its help, extra flag spellings (`aliases`, e.g. "--tp"),
    the allowed values (`choices`), a `check` returning what is wrong with a value (None: fine),
    whether it becomes a command-line flag (`cli`), and how that flag's text becomes a value
    (`parse`; default: the field's type)."""
    metadata = {"help": help, "aliases": tuple(aliases), "choices": choices, "check": check, "cli": cli}
    if parse is not None:
        metadata["parse"] = parse
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def at_least(low: int | float) -> Callable[[Any], str | None]:
    return lambda v: None if v is None or v >= low else f"must be >= {low}, got {v!r}"


def _matches(value: Any, hint: Any) -> bool:
    if hint is Any:
        return True
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_matches(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    origin = typing.get_origin(hint)
    return isinstance(value, origin or hint)


_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _describe(hint: Any) -> str:
    parts = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    names = [_TYPE_NAMES.get(p, "None" if p is type(None) else getattr(p, "__name__", str(p))) for p in parts]
    return " or ".join(names)


def validate_fields(obj: Any) -> None:
    """Each field's type, choices and check; raises ValueError naming the first bad field (the value
    cut short)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        hint = hints[f.name]
        if not _matches(value, hint):
            raise ValueError(f"{f.name}: must be {_describe(hint)}, got {short(value)}")
        choices = f.metadata.get("choices")
        if choices is not None and value not in choices:
            raise ValueError(f"{f.name}: must be one of {', '.join(map(str, choices))}; got {short(value)}")
        check = f.metadata.get("check")
        problem = check(value) if check is not None else None
        if problem:
            raise ValueError(f"{f.name}: {problem}")


def short(value: Any, limit: int = 40) -> str:
    """repr(value) cut to `limit` characters: an error message never echoes a long value back."""
    if isinstance(value, int) and value.bit_length() > 64:  # repr of a huge int is long, or raises past 4300 digits
        return f"{'-' if value < 0 else ''}<a {value.bit_length()}-bit integer>"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _device_problem(device: str) -> str | None:
    if device in ("auto", "cpu", "cuda") or (device.startswith("cuda:") and device[5:].isdigit()):
        return None
    return f"must be auto, cpu, cuda or cuda:N; got {short(device)}"


@dataclass(frozen=True)
class LoadConfig:
    """The model and how its weights load."""

    model: str | None = setting(
        None, help="checkpoint directory (config.json + safetensors); serve and demo default to the demo model"
    )
    dtype: str = setting("auto", choices=DTYPES, help="weights and activations; auto: bfloat16 on CUDA, else float32")
    device: str = setting("auto", check=_device_problem, help="cuda or cpu; auto: cuda when torch sees a GPU")
    load_format: str = setting(
        "auto", choices=LOAD_FORMATS, help="auto/safetensors: the checkpoint's weights; random: seeded random weights"
    )
    seed: int = setting(0, check=at_least(0), help="seed of random weights and of unseeded sampling")
    quantization: str | None = setting(
        None,
        choices=QUANTIZATIONS,
        help="fp8: block-FP8 weights (128 x 128 scales; quantized at load where the checkpoint is not FP8, "
        "random weights included); default: as the checkpoint's config.json says",
    )

    def __post_init__(self) -> None:
        validate_fields(self)
        if self.device == "auto":  # resolved once, where the config is built
            import torch

            object.__setattr__(self, "device", "cuda" if torch.cuda.is_available() else "cpu")
        if self.dtype == "float64" and not self.device.startswith("cpu"):
            raise ValueError("dtype: float64 runs on the CPU only (reference runs)")

    @property
    def dtype_in_use(self) -> str:
        """The dtype name the weights load in (auto resolved for the device)."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.device.startswith("cuda") else "float32"


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split over ranks (one Ray worker actor per rank)."""

    tensor_parallel_size: int = setting(
        1, aliases=("--tp",), check=at_least(1), help="ranks (GPUs) each layer is split over"
    )
    enable_expert_parallel: bool = setting(
        False, aliases=("--ep",), help="place whole MoE experts on ranks instead of slicing every expert"
    )

    def __post_init__(self) -> None:
        validate_fields(self)


def _num_kv_blocks_problem(value: int | None) -> str | None:
    return None if value is None or value >= 2 else f"must be >= 2 (one page is scratch), got {value}"


SNAPSHOT_POINTS = ("interval", "prompt_end", "last_block", "divergence", "finish")


def _policy_problem(value: str) -> str | None:
    if value in ("all", "none", ""):
        return None
    unknown = [p for p in (s.strip() for s in value.split(",")) if p not in SNAPSHOT_POINTS]
    return f"unknown point {short(unknown[0])} (one of {', '.join(SNAPSHOT_POINTS)})" if unknown else None


def _utilization_problem(value: float) -> str | None:
    return None if 0 < value <= 1 else f"must be in (0, 1], got {value!r}"


@dataclass(frozen=True)
class CacheConfig:
    """The KV page pool and GDN state slots."""

    block_size: int = setting(16, check=at_least(1), help="tokens per KV page")
    gpu_memory_utilization: float = setting(
        0.9, check=_utilization_problem, help="share of GPU memory for weights, activations and the state pools"
    )
    cpu_kv_cache_bytes: int = setting(256 * 2**20, check=at_least(0), help="bytes for the state pools on CPU")
    num_kv_blocks: int | None = setting(
        None, check=_num_kv_blocks_problem, help="exact KV page count, overriding the memory budget"
    )
    kv_cache_dtype: str = setting(
        "auto",
        choices=KV_CACHE_DTYPES,
        help="the KV pages' dtype: auto (the model's), fp8 / fp8_e4m3 (e4m3 with scale 1, saturated at +-448: "
        "half the bytes a token in bf16, attention upcasts in registers)",
    )
    enable_prefix_caching: bool = setting(
        True, help="reuse KV pages and GDN state snapshots of earlier requests' prefixes (docs/STATE_REUSE.md)"
    )
    num_prefix_snapshots: int | None = setting(
        None,
        check=at_least(0),
        help="GDN state snapshot slots for prefix caching (default: what a tenth of the pool budget holds)",
    )
    prefix_snapshot_interval: int = setting(
        1024, check=at_least(0), help="tokens between GDN snapshots along a prefill (a multiple of block_size; 0: none)"
    )
    prefix_snapshot_policy: str = setting(
        "all",
        check=_policy_problem,
        help="where snapshots are taken: all, none, or a comma list of interval, prompt_end, last_block, "
        "divergence, finish",
    )

    @property
    def kv_fp8(self) -> bool:
        """Whether the KV pages hold float8 e4m3."""
        return self.kv_cache_dtype in ("fp8", "fp8_e4m3")

    def __post_init__(self) -> None:
        validate_fields(self)
        if self.prefix_snapshot_interval % self.block_size:
            raise ValueError(
                f"prefix_snapshot_interval: must be a multiple of block_size ({self.block_size}), "
                f"got {self.prefix_snapshot_interval}"
            )


SPEC_METHODS = ("mtp",)
MAX_SPEC_TOKENS = 15  # the GDN verify tables keep k + 1 <= 16 steps


def _speculative_problem(value: dict | None) -> str | None:
    """vLLM's form, {"method": "mtp", "num_speculative_tokens": k}, k in 1..MAX_SPEC_TOKENS."""
    if value is None:
        return None
    unknown = sorted(set(value) - {"method", "num_speculative_tokens"}, key=str)
    if unknown:
        return f"unknown key {short(unknown[0])}; known: method, num_speculative_tokens"
    method = value.get("method", "mtp")
    if method not in SPEC_METHODS:
        return f"method {short(method)} is not supported (supported: {', '.join(SPEC_METHODS)})"
    k = value.get("num_speculative_tokens")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPEC_TOKENS:
        return f"num_speculative_tokens must be an integer in 1..{MAX_SPEC_TOKENS}, got {short(k)}"
    return None


def json_object(text: str) -> dict:
    """A command-line flag's JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not a JSON object ({e.msg}): {short(text)}") from None
    if not isinstance(value, dict):
        raise ValueError(f"not a JSON object: {short(text)}")
    return value


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters served beside the base model (PEFT's adapter_config.json + safetensors)."""

    enable_lora: bool = setting(False, help="serve LoRA adapters beside the base model")
    max_loras: int = setting(1, check=at_least(1), help="adapters on the device at once (slots, evicted LRU)")
    max_lora_rank: int = setting(16, check=at_least(1), help="largest adapter rank served (each slot holds this rank)")
    max_cpu_loras: int | None = setting(
        None, check=at_least(1), help="adapters each rank keeps loaded in host memory (LRU); default: max_loras"
    )
    enable_expert_lora: bool = setting(
        True,
        help="slots for adapters on the routed experts too (MoE models; memory: max_loras x rank x experts x "
        "3 (hidden + expert width) a layer); off: such adapters are refused",
    )

    def __post_init__(self) -> None:
        validate_fields(self)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras: must be >= max_loras ({self.max_loras}), got {self.max_cpu_loras}")

    @property
    def cpu_loras(self) -> int:
        return self.max_cpu_loras or self.max_loras


@dataclass(frozen=True)
class RunnerConfig:
    """How each rank runs its passes."""

    enforce_eager: bool = setting(False, help="run every pass without CUDA graphs")
    cuda_graph_max_batch: int = setting(256, check=at_least(1), help="largest decode batch replayed from a CUDA graph")
    prefill_graph_max_tokens: int = setting(
        2048,
        check=at_least(0),
        help="largest prefill pass (one prompt chunk: a prefix-cache hit's new tokens, a short prompt) replayed "
        "from a CUDA graph (0: none)",
    )
    time_passes: bool = setting(
        False, help="CUDA events around each pass: GPU busy and idle time per pass (benchmarks)"
    )
    kernels: KernelOptions = setting(
        default_factory=KernelOptions.from_env,
        cli=False,
        help="kernel choices; default: the DELTASERVE_* environment, read when the config is built",
    )
    speculative_config: dict | None = setting(
        None,
        check=_speculative_problem,
        parse=json_object,
        help='speculative decoding with the checkpoint\'s MTP head, e.g. {"method": "mtp", '
        '"num_speculative_tokens": 3} (1..15 drafts verified per step; docs/SPEC_DECODE.md)',
    )

    def __post_init__(self) -> None:
        validate_fields(self)

    @property
    def num_speculative_tokens(self) -> int:
        """Drafts verified per step (0: no speculative decoding)."""
        return self.speculative_config["num_speculative_tokens"] if self.speculative_config else 0


@dataclass(frozen=True)
class WorkerConfig:
    """What one rank is given: its sections of the engine's configuration, and the batch limits the
    driver plans within (the pools are sized and the warm-up passes shaped for them)."""

    load: LoadConfig
    parallel: ParallelConfig
    cache: CacheConfig
    runner: RunnerConfig
    max_num_seqs: int
    max_num_batched_tokens: int
    lora: LoraConfig = field(default_factory=LoraConfig)
