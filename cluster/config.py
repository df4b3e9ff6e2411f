"""The engine's configuration: one tree of frozen dataclasses.

    EngineConfig
      load       LoadConfig       model, dtype, device, load_format, seed           (workers/config.py)
      parallel   ParallelConfig   tensor_parallel_size, enable_expert_parallel      (workers/config.py)
      cache      CacheConfig      block_size, gpu_memory_utilization, ...           (workers/config.py)
      scheduler  SchedulerConfig  max_num_seqs, max_num_batched_tokens, ...         (here)
      runner     RunnerConfig     enforce_eager, cuda_graph_max_batch, kernels, ... (workers/config.py)
      lora       LoraConfig       enable_lora, max_loras, max_lora_rank, ...        (workers/config.py)
      serving    ServingConfig    max_waiting_requests, served_model_name, ...      (here)
      data_parallel DataParallelConfig data_parallel_size, routing, ...             (here)
      executor   "auto" | "local" | "ray"

Each field's default and help are written once, in its section (`setting`). Field names are vLLM's
where vLLM has the setting and are unique across the tree, so the tree also reads as flat keyword
arguments: `EngineConfig.from_kwargs(model=..., max_num_seqs=8)` (what `LLM(**kwargs)` takes), and
`add_engine_args` makes one command-line flag per field. A new section is a dataclass field of
EngineConfig; a new setting is a field of its section: the keyword argument and the flag follow.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass
from typing import Any

from deltaserve.workers.config import (
    CacheConfig,
    LoadConfig,
    LoraConfig,
    ParallelConfig,
    RunnerConfig,
    WorkerConfig,
    at_least,
    json_object,
    setting,
    short,
    validate_fields,
)

EXECUTORS = ("auto", "local", "ray")
ROUTING = ("least_loaded", "prefix_aware")
SCHEDULING_POLICIES = ("fcfs", "priority")
REASONING_PARSERS = ("qwen3",)  # chat completions' reasoning into reasoning_content (vLLM's names)
TOOL_CALL_PARSERS = ("hermes", "qwen3_coder")  # their tool calls into tool_calls


@dataclass(frozen=True)
class SchedulerConfig:
    """How the driver batches requests into passes."""

    max_num_seqs: int = setting(64, check=at_least(1), help="most sequences in one pass (and GDN state slots)")
    max_num_batched_tokens: int = setting(
        2048, check=at_least(1), help="token budget of one pass; longer prompts are prefilled in chunks"
    )
    max_model_len: int | None = setting(
        None, check=at_least(2), help="longest prompt + output; default: the model's limit, capped by the KV pool"
    )
    enable_chunked_prefill: bool = setting(True, help="split prompts longer than the token budget across passes")
    async_scheduling: bool | None = setting(
        None, help="plan the next pass while the current one runs; default: wherever the executor can overlap passes"
    )
    scheduling_policy: str = setting(
        "fcfs",
        choices=SCHEDULING_POLICIES,
        help="fcfs: requests in arrival order; priority: by each request's `priority` (lower first, then arrival),"
        " a waiting request preempting running ones of a lower priority when it does not fit",
    )

    def __post_init__(self) -> None:
        validate_fields(self)


@dataclass(frozen=True)
class ServingConfig:
    """What the serving front doors enforce."""

    max_waiting_requests: int = setting(
        1024, check=at_least(1), help="waiting requests beyond which new ones are refused (RESOURCE_EXHAUSTED, 429)"
    )
    served_model_name: str | None = setting(
        None, help="the model's name in the OpenAI API (`model`, /v1/models); default: the --model argument"
    )
    chat_template: str | None = setting(
        None, help="a Jinja chat template (a file or the text) instead of the checkpoint's own"
    )
    reasoning_parser: str | None = setting(
        None,
        check=lambda v: _one_of(v, REASONING_PARSERS),
        help="chat completions: the reasoning (qwen3: <think> ... </think>) goes to reasoning_content",
    )
    tool_call_parser: str | None = setting(
        None,
        check=lambda v: _one_of(v, TOOL_CALL_PARSERS),
        help="chat completions given tools: the calls in the text go to tool_calls (hermes: JSON in <tool_call> "
        "tags, Qwen3's and the demo's; qwen3_coder: <function=...> <parameter=...> blocks, Qwen3.5's)",
    )
    generation_config: str = setting(
        "auto",
        help="the sampling defaults of requests that leave them unset (HTTP, gRPC, LLM.generate without "
        "SamplingParams): auto, the checkpoint's generation_config.json (its temperature, top_p, top_k, min_p, "
        "repetition_penalty, as vLLM); vllm, SamplingParams' own; or a folder holding a generation_config.json",
    )
    override_generation_config: dict | None = setting(
        None,
        parse=json_object,
        help='sampling defaults replacing or adding to generation_config\'s, e.g. {"temperature": 0.5}',
    )

    def __post_init__(self) -> None:
        validate_fields(self)


def _one_of(value: str | None, names: tuple[str, ...]) -> str | None:
    return None if value is None or value in names else f"must be one of {', '.join(names)}; got {value!r}"


@dataclass(frozen=True)
class DataParallelConfig:
    """Engine replicas behind one router (served engines): each replica is a driver and its TP/EP worker
    group, packed on one node; the replicas spread over the Ray cluster's nodes."""

    data_parallel_size: int = setting(
        1, aliases=("--dp",), check=at_least(1), help="engine replicas, each with its own TP/EP worker group"
    )
    routing: str = setting(
        "least_loaded",
        choices=ROUTING,
        help="which replica takes a request: the one with the fewest in flight, or the one whose prefix cache "
        "holds the longest prefix of the prompt (among those not far busier than the least loaded)",
    )
    replica_down_after_s: float = setting(
        10.0,
        check=at_least(1.0),
        help="a replica that has not answered for this long is declared down (its requests end UNAVAILABLE) and "
        "placed again; it takes no new requests after a second of silence",
    )

    def __post_init__(self) -> None:
        validate_fields(self)


@dataclass(frozen=True)
class EngineConfig:
    load: LoadConfig = dataclasses.field(default_factory=LoadConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    runner: RunnerConfig = dataclasses.field(default_factory=RunnerConfig)
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    serving: ServingConfig = dataclasses.field(default_factory=ServingConfig)
    data_parallel: DataParallelConfig = dataclasses.field(default_factory=DataParallelConfig)
    executor: str = setting(
        "auto", choices=EXECUTORS, cli=False, help="local: the model in this process (one rank); ray: worker actors"
    )

    def __post_init__(self) -> None:
        validate_fields(self)
        single = self.parallel.tensor_parallel_size == 1 and not self.parallel.enable_expert_parallel
        if self.executor == "local" and not single:
            raise ValueError("executor: 'local' runs one rank; tensor or expert parallelism needs 'ray'")
        if self.executor == "local" and self.data_parallel.data_parallel_size > 1:
            raise ValueError("executor: 'local' runs one engine in this process; data_parallel_size needs 'ray'")

    # ---- flat views ------------------------------------------------------------------------------
    @classmethod
    def from_kwargs(cls, **flat: Any) -> EngineConfig:
        """The tree from flat keyword arguments (any field of any section, a whole section by its name,
        or `kernels`); an unknown name is an error naming it."""
        sections: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
        root: dict[str, Any] = {}
        for name, value in flat.items():
            if name in _SECTIONS and isinstance(value, _SECTIONS[name]):
                root[name] = value
            elif name in _OWNER:
                owner = _OWNER[name]
                (root if owner is None else sections[owner])[name] = value
            else:
                raise ValueError(f"{name}: not an engine setting")
        for name, values in sections.items():
            if name in root and values:
                raise ValueError(f"{next(iter(values))}: given both alone and inside {name}")
            if name not in root:
                root[name] = _SECTIONS[name](**values)
        return cls(**root)

    def replace(self, **flat: Any) -> EngineConfig:
        """A copy with some settings (flat names) changed, checked like a new one."""
        return EngineConfig.from_kwargs(**{**self.to_kwargs(), **flat})

    def to_kwargs(self) -> dict[str, Any]:
        """Every setting by its flat name (`from_kwargs` of the result is this config)."""
        return {f.name: getattr(self if _OWNER[f.name] is None else getattr(self, _OWNER[f.name]), f.name)
                for f in engine_settings()}  # fmt: skip

    def worker_config(self) -> WorkerConfig:
        """What each rank needs of this configuration."""
        return WorkerConfig(
            load=self.load,
            parallel=self.parallel,
            cache=self.cache,
            runner=self.runner,
            max_num_seqs=self.scheduler.max_num_seqs,
            max_num_batched_tokens=self.scheduler.max_num_batched_tokens,
            lora=self.lora,
        )


# section name -> its dataclass; field name -> the section that holds it (None: EngineConfig itself)
_SECTIONS: dict[str, type] = {
    f.name: f.default_factory for f in dataclasses.fields(EngineConfig) if f.default_factory is not dataclasses.MISSING
}
_OWNER: dict[str, str | None] = {}
for _section, _cls in (*_SECTIONS.items(), (None, EngineConfig)):
    for _f in dataclasses.fields(_cls):
        if _f.name in _SECTIONS:
            continue
        assert _f.name not in _OWNER, f"setting {_f.name} is defined twice"
        _OWNER[_f.name] = _section


def engine_settings() -> list[dataclasses.Field]:
    """Every setting of the tree, in tree order."""
    out = []
    for section, cls in (*_SECTIONS.items(), (None, EngineConfig)):
        out += [f for f in dataclasses.fields(cls) if f.name not in _SECTIONS and _OWNER[f.name] == section]
    return out


def _hint(f: dataclasses.Field) -> Any:
    owner = _OWNER[f.name]
    cls = EngineConfig if owner is None else _SECTIONS[owner]
    return typing.get_type_hints(cls)[f.name]


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def add_engine_args(
    parser: argparse.ArgumentParser,
    *,
    exclude: tuple[str, ...] = (),
    defaults: dict[str, Any] | None = None,
    title: str = "engine",
) -> None:
    """One flag per engine setting (`--max-num-seqs`, plus aliases such as `--tp`), its help and default
    taken from the field. A flag not given leaves the field's default: `engine_kwargs` returns only the
    settings the command line gave (and `defaults`, this parser's own defaults)."""
    defaults = defaults or {}
    group = parser.add_argument_group(title)
    for f in engine_settings():
        if not f.metadata.get("cli", True) or f.name in exclude:
            continue
        hint = _hint(f)
        kinds = typing.get_args(hint) or (hint,)
        kind = next(k for k in kinds if k is not type(None))
        default = defaults.get(f.name, _default(f))
        options: dict[str, Any] = {
            "dest": f.name,
            "default": defaults.get(f.name, argparse.SUPPRESS),
            "help": f"{f.metadata['help']} (default: {default})",
        }
        if kind is bool:
            plain_switch = default is False and type(None) not in kinds
            options["action"] = "store_true" if plain_switch else argparse.BooleanOptionalAction
        else:
            options["type"] = _flag_parser(f) if f.metadata.get("parse") else kind
            if f.metadata.get("choices"):
                options["choices"] = f.metadata["choices"]
        group.add_argument("--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ()), **options)


def _flag_parser(f: dataclasses.Field):
    """The field's `parse`, its errors as argparse's (the flag and what is wrong, in one line)."""
    parse = f.metadata["parse"]

    def flag_value(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return flag_value


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine settings present on a namespace parsed with `add_engine_args`."""
    names = {f.name for f in engine_settings()}
    return {name: value for name, value in vars(args).items() if name in names}


__all__ = [
    "CacheConfig",
    "DataParallelConfig",
    "EngineConfig",
    "LoadConfig",
    "LoraConfig",
    "ParallelConfig",
    "RunnerConfig",
    "SchedulerConfig",
    "ServingConfig",
    "WorkerConfig",
    "add_engine_args",
    "engine_kwargs",
    "engine_settings",
    "short",
]
