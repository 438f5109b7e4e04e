"""One streaming request against an OpenAI-compatible server, timed chunk by chunk.

Definitions follow vLLM's benchmark_serving so numbers compare across servers:
- TTFT: request sent -> first chunk carrying generated text.
- ITL: gaps between successive text chunks (with speculation one chunk can hold several tokens).
- TPOT: (e2e - TTFT) / (output tokens - 1), output tokens from `usage` when the server reports it.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from loadtests.workloads import WorkItem


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

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["tpot"] = self.tpot
        return d


@dataclass(slots=True)
class RequestOptions:
    endpoint: str = "chat"  # "chat" -> /v1/chat/completions, "completions" -> /v1/completions
    model: str | None = None  # None: leave the field out (the server's default model)
    max_tokens: int = 64
    ignore_eos: bool = False
    timeout_s: float = 600.0
    extra_body: dict[str, Any] = field(default_factory=dict)


def build_payload(item: WorkItem, opts: RequestOptions) -> tuple[str, dict[str, Any]]:
    """-> (path, JSON body)."""
    body: dict[str, Any] = {
        "max_tokens": opts.max_tokens,
        "temperature": item.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if opts.model is not None:
        body["model"] = opts.model
    if opts.ignore_eos:
        body["ignore_eos"] = True  # vLLM / specserve extension; other servers ignore or refuse it
    body.update(item.extra)
    body.update(opts.extra_body)
    if opts.endpoint == "chat":
        return "/v1/chat/completions", {**body, "messages": item.messages}
    if opts.endpoint == "completions":
        return "/v1/completions", {**body, "prompt": item.prompt_text()}
    raise ValueError(f"unknown endpoint {opts.endpoint!r}")


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
    t0 = time.perf_counter()
    res = RequestResult(item_id=item.id, temperature=item.temperature, start=t0 - run_t0)
    last = t0
    try:
        async with client.stream("POST", base_url.rstrip("/") + path, json=body,
                                 timeout=opts.timeout_s) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:300]
                res.error = f"HTTP {resp.status_code}: {detail}"
                return res
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
                    return res
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
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"[:300]
    return res
