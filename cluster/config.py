"""The engine's configuration."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    model: str | None
    dtype: str = "auto"
    device: str = "cpu"
    load_format: str = "auto"
    seed: int = 0
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_bytes: int = 256 * 2**20
    num_kv_blocks: int | None = None  # exact KV page count, overriding the memory budget
    # the gateway answers RESOURCE_EXHAUSTED beyond this many waiting requests
    max_waiting_requests: int = 1024
    enable_cuda_graphs: bool = True  # decode passes replay captured CUDA graphs
    # plan and launch pass N+1 before pass N's tokens are back (executors that overlap passes: the
    # local one, and the Ray executor over "shm"; its "compiled" and "calls" transports run passes
    # synchronously whatever this says)
    # None or True: wherever supported (measured on one H200 and on two with TP = 2); False: never
    async_scheduling: bool | None = None
    # CUDA events around each pass on the device (benchmarks): each RunnerOutput then says how long
    # the pass kept the GPU busy and how long the GPU sat idle between the previous pass and it
    time_passes: bool = False
    # "local": the model in this process (TP = 1 only); "ray": worker actors; "auto": local when TP = 1
    executor: str = "auto"

    def validate(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size: must be >= 1, got {self.tensor_parallel_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens: must be >= 1, got {self.max_num_batched_tokens}")
        if self.block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {self.block_size}")
        if self.executor not in ("auto", "local", "ray"):
            raise ValueError(f"executor: must be auto, local or ray; got {self.executor!r}")
        if self.executor == "local" and (self.tensor_parallel_size > 1 or self.enable_expert_parallel):
            raise ValueError("executor: 'local' runs one rank; tensor or expert parallelism needs 'ray'")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")


def runner_config(config: EngineConfig):
    from deltaserve.workers.runner import RunnerConfig

    return RunnerConfig(
        model=config.model,
        dtype=config.dtype,
        device=config.device,
        load_format=config.load_format,
        seed=config.seed,
        block_size=config.block_size,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        gpu_memory_utilization=config.gpu_memory_utilization,
        cpu_kv_cache_bytes=config.cpu_kv_cache_bytes,
        num_kv_blocks=config.num_kv_blocks,
        enable_cuda_graphs=config.enable_cuda_graphs,
        time_passes=config.time_passes,
    )
