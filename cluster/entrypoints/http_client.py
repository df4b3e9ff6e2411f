"""A small asyncio client of the OpenAI-compatible HTTP server (httpx), for the demo and for
`bench serve --backend openai`: it streams /v1/completions (or /v1/chat/completions) and yields the
same Chunk / Final items as the gRPC client, so one load generator drives both front doors. It asks
for vLLM's `return_token_ids`, so token counts and inter-token gaps are the server's tokens, and for
the usage chunk, so the Final's counts are the server's. Users reach the server with the `openai`
package (README); this client exists to measure it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import httpx

from .client import Chunk, Final


class HttpStatusError(RuntimeError):
    """The server answered with an error status (OpenAI's error object in the body)."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message

    @property
    def status_name(self) -> str:
        return f"HTTP_{self.status}"


@dataclass(frozen=True)
class HttpModelInfo:
    """What the benchmark needs from /v1/models (the gRPC ModelInfo's names)."""

    model: str
    served_name: str
    max_model_len: int
    vocab_size: int


class OpenAIHttpClient:
    def __init__(
        self, base_url: str, *, api_key: str | None = None, verify: bool | str = True, model: str | None = None
    ):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self._http = httpx.AsyncClient(base_url=base_url, headers=headers, verify=verify, timeout=None, limits=limits)
        self.model = model

    async def model_info(self) -> HttpModelInfo:
        card = (await self._json("GET", "/v1/models"))["data"][0]
        self.model = self.model or card["id"]
        return HttpModelInfo(card.get("root") or card["id"], card["id"], card["max_model_len"], card["vocab_size"])

    async def tokenize(self, text: str) -> list[int]:
        return (await self._json("POST", "/tokenize", json={"prompt": text}))["tokens"]

    async def generate(
        self,
        prompt: str | Sequence[int] | Sequence[dict],
        *,
        request_id: str = "",
        timeout_s: float | None = None,
        **sampling,
    ) -> AsyncIterator[Chunk | Final]:
        """Stream one completion (a list of message dicts: a chat completion)."""
        chat = bool(prompt) and not isinstance(prompt, str) and isinstance(prompt[0], dict)
        body = {name: value for name, value in sampling.items() if value is not None}
        body |= {
            "model": self.model,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }
        body["messages" if chat else "prompt"] = prompt if isinstance(prompt, str) else list(prompt)
        if request_id:
            body["request_id"] = request_id
        path = "/v1/chat/completions" if chat else "/v1/completions"
        finish, stop, rid = None, None, request_id
        async with self._http.stream("POST", path, json=body, timeout=timeout_s) as response:
            if response.status_code != 200:
                await response.aread()
                raise _status_error(response)
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise HttpStatusError(int(event["error"].get("code") or 500), event["error"]["message"])
                rid = event.get("id", rid)
                for choice in event.get("choices") or []:
                    text = (choice["delta"].get("content") if chat else choice.get("text")) or ""
                    ids = choice.get("token_ids") or []
                    if text or ids:
                        yield Chunk(ids, text, index=choice.get("index", 0))
                    if choice.get("finish_reason"):
                        finish, stop = choice["finish_reason"], choice.get("stop_reason")
                usage = event.get("usage")
                if usage and not event.get("choices"):
                    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                    yield Final(rid, finish, stop, usage["prompt_tokens"], usage["completion_tokens"], cached, None)

    async def respond(self, text: str, **fields) -> dict:
        """One whole answer of the Responses API (`POST /v1/responses`): the response object."""
        return await self._json("POST", "/v1/responses", json={"model": self.model, "input": text, **fields})

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> OpenAIHttpClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _json(self, method: str, path: str, **kwargs) -> dict:
        response = await self._http.request(method, path, **kwargs)
        if response.status_code != 200:
            raise _status_error(response)
        return response.json()


def _status_error(response: httpx.Response) -> HttpStatusError:
    try:
        message = response.json()["error"]["message"]
    except Exception:
        message = response.text[:200]
    return HttpStatusError(response.status_code, message)
