"""`LLM`: the offline API users know from vLLM.

from deltaserve import LLM, SamplingParams
llm = LLM(model="path/to/checkpoint")
outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tqdm import tqdm

from .engine import EngineConfig, EngineCore, WorkerFailure
from .request import RequestOutput
from .sampling_params import SamplingParams

PromptLike = str | list[int] | dict


class LLM:
    def __init__(
        self,
        model: str | None,
        *,
        dtype: str = "auto",
        device: str | None = None,
        tensor_parallel_size: int = 1,
        enable_expert_parallel: bool = False,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        block_size: int = 16,
        gpu_memory_utilization: float = 0.9,
        cpu_kv_cache_bytes: int = 256 * 2**20,
        num_kv_blocks: int | None = None,
        enforce_eager: bool = False,
        async_scheduling: bool | None = None,
        time_passes: bool = False,
        seed: int = 0,
        load_format: str = "auto",
        enable_prefix_caching: bool = True,
        num_prefix_snapshots: int | None = None,
        prefix_snapshot_interval: int = 1024,
        prefix_snapshot_policy: str = "all",
        speculative_config: dict | None = None,
        model_config=None,
    ):
        if device is None:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.config = EngineConfig(
            model=model,
            dtype=dtype,
            device=device,
            load_format=load_format,
            seed=seed,
            tensor_parallel_size=tensor_parallel_size,
            enable_expert_parallel=enable_expert_parallel,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            block_size=block_size,
            gpu_memory_utilization=gpu_memory_utilization,
            cpu_kv_cache_bytes=cpu_kv_cache_bytes,
            num_kv_blocks=num_kv_blocks,
            enable_cuda_graphs=not enforce_eager,
            async_scheduling=async_scheduling,
            time_passes=time_passes,
            enable_prefix_caching=enable_prefix_caching,
            num_prefix_snapshots=num_prefix_snapshots,
            prefix_snapshot_interval=prefix_snapshot_interval,
            prefix_snapshot_policy=prefix_snapshot_policy,
            speculative_config=speculative_config,
        )
        self.engine = EngineCore(self.config, model_config=model_config, output_mode="final")
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptLike | Sequence[PromptLike],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, or {"prompt_token_ids": [...]}); returns
        the final outputs in prompt order. Bad input raises ValueError naming the field before
        anything runs."""
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        requests = [
            self.engine.make_request(i, p, sp, salt) for i, (p, salt), sp in zip(ids, prompts, params, strict=True)
        ]
        del requests  # validated all before queueing any
        for req_id, (prompt, salt), sp in zip(ids, prompts, params, strict=True):
            self.engine.add_request(req_id, prompt, sp, salt)
        final: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generate", disable=not use_tqdm or len(ids) < 2, unit="req") as bar:
            while len(final) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
                        bar.update(1)
        failed = [final[i] for i in ids if final[i].outputs[0].finish_reason == "error"]
        if failed:
            raise WorkerFailure(f"{len(failed)} of {len(ids)} requests failed: {failed[0].error}")
        return [final[i] for i in ids]

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (KV blocks and GDN snapshots); safe while requests run."""
        return self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine.shutdown()


def _as_prompt_list(prompts) -> list[tuple[str | list[int], str | None]]:
    """(prompt, cache_salt) per prompt."""
    single_ids = isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)
    if isinstance(prompts, str | dict) or single_ids:
        prompts = [prompts]
    out = []
    for p in prompts:
        salt = None
        if isinstance(p, dict):
            salt = p.get("cache_salt")
            if "prompt_token_ids" in p:
                p = list(p["prompt_token_ids"])
            elif "prompt" in p:
                p = p["prompt"]
            else:
                raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        out.append((p, salt))
    if not out:
        raise ValueError("prompts: at least one prompt is required")
    return out
