"""One streaming request against an OpenAI-compatible server, timed chunk by chunk.

Definitions follow vLLM's `vllm bench serve` so numbers compare across servers:
- TTFT: request sent -> first chunk carrying generated text.
- ITL: gaps between successive text chunks (with speculation one chunk can hold several tokens).
- TPOT: (e2e - TTFT) / (output tokens - 1), output tokens from `usage` when the server reports it.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from loadtests.datasets import WorkItem


@dataclass(slots=True)
class RequestResult:
    item_id: str
    temperature: float
    start: float  # seconds since the run started
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int = 0
    chunks: int = 0  # text chunks received
    usage_reported: bool = False
    finish_reason: str | None = None
    retries: int = 0  # connection attempts dropped before any response, then retried
    request_class: str | None = None  # the item's class, where the dataset gives one

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["tpot"] = self.tpot
        return d


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@dataclass(slots=True)
class RequestOptions:
    endpoint: str = CHAT
    model: str | None = None  # None: leave the field out (the server's default model)
    max_tokens: int = 64  # for items that do not set their own
    temperature: float | None = None  # None: each item's own (greedy unless the dataset samples)
    ignore_eos: bool = False
    api_key: str | None = None
    timeout_s: float = 600.0
    max_retries: int = 2  # the openai SDK's default
    extra_body: dict[str, Any] = field(default_factory=dict)


def build_payload(item: WorkItem, opts: RequestOptions) -> tuple[str, dict[str, Any]]:
    """-> (path, JSON body)."""
    body: dict[str, Any] = {
        "max_tokens": item.max_tokens or opts.max_tokens,
        "temperature": item.temperature if opts.temperature is None else opts.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if opts.model is not None:
        body["model"] = opts.model
    if opts.ignore_eos:
        body["ignore_eos"] = True  # vLLM / specserve extension; other servers ignore or refuse it
    body.update(item.extra)
    body.update(opts.extra_body)
    if item.prompt_ids is not None:
        if opts.endpoint != COMPLETIONS:
            raise ValueError(f"token-id prompts need the {COMPLETIONS} endpoint")
        return COMPLETIONS, {**body, "prompt": item.prompt_ids}
    if opts.endpoint == CHAT:
        return CHAT, {**body, "messages": item.messages}
    if opts.endpoint == COMPLETIONS:
        return COMPLETIONS, {**body, "prompt": item.prompt_text()}
    raise ValueError(f"unknown endpoint {opts.endpoint!r} ({CHAT} or {COMPLETIONS})")


def _chunk_text(obj: dict[str, Any]) -> str:
    text = ""
    for choice in obj.get("choices") or []:
        delta = choice.get("delta")
        if isinstance(delta, dict):
            text += delta.get("content") or delta.get("reasoning_content") or ""
        else:
            text += choice.get("text") or ""
    return text


def _finish_reason(obj: dict[str, Any]) -> str | None:
    for choice in obj.get("choices") or []:
        if choice.get("finish_reason"):
            return str(choice["finish_reason"])
    return None


async def stream_request(client: httpx.AsyncClient, base_url: str, item: WorkItem, opts: RequestOptions,
                         run_t0: float) -> RequestResult:
    path, body = build_payload(item, opts)
    t0 = time.perf_counter()  # latencies count from the first attempt: what the user waits for
    res = RequestResult(item_id=item.id, temperature=body["temperature"], start=t0 - run_t0,
                        request_class=item.request_class)
    for attempt in range(opts.max_retries + 1):
        try:
            await _attempt(client, base_url.rstrip("/") + path, body, opts, res, t0)
            return res
        except _NoResponse as e:
            # Like the openai SDK: a connection dropped before any response (e.g. the full accept queue
            # of a server that takes few connections at once) is retried with backoff; later errors not.
            res.error = str(e)
            if attempt < opts.max_retries:
                res.retries += 1
                await asyncio.sleep(0.5 * 2**attempt)
    return res


class _NoResponse(Exception):
    pass


async def _attempt(client: httpx.AsyncClient, url: str, body: dict[str, Any], opts: RequestOptions,
                   res: RequestResult, t0: float) -> None:
    res.error = None
    try:
        headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else None
        cm = client.stream("POST", url, json=body, headers=headers, timeout=opts.timeout_s)
        try:
            resp = await cm.__aenter__()
        except httpx.TransportError as e:
            raise _NoResponse(f"{type(e).__name__}: {e}"[:300]) from None
        try:
            await _read_stream(resp, res, t0)
        finally:
            await cm.__aexit__(None, None, None)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"[:300]


async def _read_stream(resp: httpx.Response, res: RequestResult, t0: float) -> None:
    if resp.status_code != 200:
        detail = (await resp.aread()).decode(errors="replace")[:300]
        res.error = f"HTTP {resp.status_code}: {detail}"
        return
    last = t0
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        now = time.perf_counter()
        obj = json.loads(data)
        if "error" in obj:
            res.error = str(obj["error"])[:300]
            return
        if obj.get("usage"):
            usage = obj["usage"]
            res.prompt_tokens = usage.get("prompt_tokens")
            res.output_tokens = int(usage.get("completion_tokens") or 0)
            res.usage_reported = True
        res.finish_reason = _finish_reason(obj) or res.finish_reason
        if _chunk_text(obj):
            if res.ttft is None:
                res.ttft = now - t0
            else:
                res.itl.append(now - last)
            last = now
            res.chunks += 1
    res.e2e = time.perf_counter() - t0
    if not res.usage_reported:
        res.output_tokens = res.chunks  # servers without usage: one token per chunk, approximately
    res.ok = res.ttft is not None or res.output_tokens == 0
    if not res.ok:
        res.error = "no text received"


def resolve_model(base_url: str, api_key: str | None = None) -> str | None:
    """The first model the server lists at /v1/models (what vLLM's client does without --model); None when
    it lists none or has no such route, and requests then leave the field out."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    try:
        resp = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
        data = resp.json().get("data") if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    return str(data[0]["id"]) if data and isinstance(data[0], dict) and "id" in data[0] else None


def normalize_base_url(url: str) -> str:
    """The server root: users paste the OpenAI base URL (".../v1") as often as the root."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url
