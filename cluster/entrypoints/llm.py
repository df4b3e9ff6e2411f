"""`LLM`: the offline API users know from vLLM.

from deltaserve import LLM, SamplingParams
llm = LLM(model="path/to/checkpoint")
outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
outputs = llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(max_tokens=32))
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from deltaserve.cluster.config import EngineConfig
from deltaserve.cluster.core.lora import LoRARequest
from deltaserve.cluster.core.request import RequestOutput
from deltaserve.cluster.core.sampling_params import SamplingParams
from deltaserve.cluster.executors.base import WorkerFailure
from deltaserve.layers.config import ModelConfig

from . import validation
from .chat_template import ChatTemplate, load_override
from .startup import build_engine, sampling_defaults

PromptLike = str | list[int] | dict


class LLM:
    """`LLM(model, **settings)`: the settings are EngineConfig's fields by their flat names, vLLM's where
    vLLM has them (`tensor_parallel_size`, `max_num_seqs`, `enforce_eager`, `dtype`, ...; see
    `deltaserve.cluster.config`); a wrong name or value is a ValueError naming it. `model_config` stands
    in for the checkpoint's config.json (benchmarks on random weights)."""

    def __init__(self, model: str | None = None, *, model_config: ModelConfig | None = None, **settings: Any):
        self.config = EngineConfig.from_kwargs(model=model, **settings)
        if self.config.data_parallel.data_parallel_size > 1:
            raise ValueError(
                "data_parallel_size: LLM runs one engine; serve replicas with `deltaserve serve --data-parallel-size`"
            )
        self.engine = build_engine(self.config, model_config=model_config, output_mode="final")
        self.chat_template = ChatTemplate.for_model(self.config.load.model, self.config.serving.chat_template)
        self.default_sampling = sampling_defaults(self.config)
        self._ids = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` sample with when given no SamplingParams: the model's
        generation_config.json sampling fields (`generation_config`), as vLLM's."""
        return SamplingParams(**self.default_sampling)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptLike | Sequence[PromptLike],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, or {"prompt_token_ids": [...]}); returns
        the final outputs in prompt order. `lora_request`: the adapter of every prompt, or one per
        prompt (None: the base model); an adapter not registered yet is registered (add_lora).
        `priority`: one per prompt, lower first (needs scheduling_policy="priority"). Bad input
        raises ValueError naming the field before anything runs."""
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"lora_request: {len(loras)} given for {len(prompts)} prompts")
        ranks = [0] * len(prompts) if priority is None else list(priority)
        if len(ranks) != len(prompts):
            raise ValueError(f"priority: {len(ranks)} given for {len(prompts)} prompts")
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        for i, (p, salt), sp, lora, rank in zip(ids, prompts, params, loras, ranks, strict=True):
            self.engine.make_request(i, p, sp, salt, lora, rank)  # validate all before queueing any
        for req_id, (prompt, salt), sp, lora, rank in zip(ids, prompts, params, loras, ranks, strict=True):
            self.engine.add_request(req_id, prompt, sp, salt, lora, rank)
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

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's LLM.chat: one conversation (a list of {"role", "content"} messages) or several,
        each rendered by the model's chat template (or `chat_template`: a file or the text) and
        generated like `generate`'s prompts (`lora_request` as there)."""
        template = self.chat_template
        if chat_template is not None:
            specials = template.special_tokens if template is not None else {}
            template = ChatTemplate(load_override(chat_template), specials)
        if template is None:
            raise ValueError("chat_template: this model has none; pass chat_template=")
        single = isinstance(messages, list | tuple) and (not messages or isinstance(messages[0], dict))
        conversations = [messages] if single else list(messages)
        prompts = [
            template.render(
                validation.chat_messages(conversation),
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                template_kwargs=chat_template_kwargs,
            )
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register an adapter, checked against the model (ValueError naming the file and field)."""
        return self.engine.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unregister an adapter; requests running on it finish on it."""
        return self.engine.remove_lora(lora_int_id)

    def list_loras(self) -> list[LoRARequest]:
        return self.engine.list_loras()

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (KV blocks and GDN snapshots); safe while requests run."""
        return self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine.shutdown()


def _as_prompt_list(prompts) -> list[tuple[str | list[int], str | None]]:
    """(prompt, cache_salt) per prompt; a dict prompt may carry a "cache_salt"."""
    if not isinstance(prompts, str | dict | list | tuple):
        raise ValueError(
            f"prompts: must be a string, a list of token ids, a dict or a list of those; got {type(prompts).__name__}"
        )
    single_ids = isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)
    if isinstance(prompts, str | dict) or single_ids:
        prompts = [prompts]
    out = []
    for p in prompts:
        salt = None
        if isinstance(p, dict):
            salt = p.get("cache_salt")
            if "prompt_token_ids" in p:
                p = p["prompt_token_ids"]
            elif "prompt" in p:
                p = p["prompt"]
            else:
                raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        out.append((p, salt))
    if not out:
        raise ValueError("prompts: at least one prompt is required")
    return out
