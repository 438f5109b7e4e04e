"""The FastAPI app: routes, API-key / body-size guard, lifespan (engine thread + stats log)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import pydantic_core
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import engine
from server.engine_client import EngineClient
from server.errors import APIError, install_error_handlers, internal_error, request_id_of
from server.metrics import CONTENT_TYPE, format_spec_line, format_stats_line
from server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from server.serving import OpenAIServing
from server.serving_chat import ChatServing
from server.serving_completions import CompletionServing
from server.serving_tokenization import TokenizationServing
from server.settings import ServerSettings

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/metrics"})  # monitoring stays reachable without the API key
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


class GuardMiddleware:
    """Pure ASGI (no BaseHTTPMiddleware: it would hide client disconnects from streaming responses).

    1. API key: `Authorization: Bearer KEY`, compared in constant time, on every path but OPEN_PATHS.
    2. Body size: 413 from Content-Length, or while reading a chunked body, before any parsing.
    """

    def __init__(self, app: ASGIApp, api_key: str | None, max_body: int) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.api_key is not None and scope["path"] not in OPEN_PATHS and not self._authorized(scope):
            err = APIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            await err.response()(scope, receive, send)
            return
        if scope["method"] not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        too_large = APIError(413, f"request body is larger than the limit of {self.max_body} bytes",
                             code="request_too_large")
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            await too_large.response()(scope, receive, send)
            return
        # Buffer the body (bounded), then replay it; later receive() calls go to the server so the
        # app still sees `http.disconnect`.
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # client gone before sending its body
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_body:
                await too_large.response()(scope, receive, send)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _authorized(self, scope: Scope) -> bool:
        auth = _header(scope, b"authorization") or ""
        scheme, _, token = auth.partition(" ")
        assert self.api_key is not None
        # compare_digest on equal-type bytes: time does not depend on where the strings differ
        return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), self.api_key)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def _guard(raw: Request, work: Awaitable[Response]) -> Response:
    """Turn an unexpected exception into a 500 for this request only (logged once, here)."""
    try:
        return await work
    except APIError:
        raise
    except Exception as e:
        raise internal_error(request_id_of(raw), e) from e


async def _log_stats(client: EngineClient, interval: float) -> None:
    idle_logged = False
    while True:
        await asyncio.sleep(interval)
        window = client.metrics.take_log_window()
        snap = client.metrics.snapshot()
        idle = not (window.prompt_tokens or window.generation_tokens or snap.num_running or snap.num_waiting)
        if idle and idle_logged:
            continue  # one line saying "idle" is enough
        idle_logged = idle
        logger.info(format_stats_line(window, snap))
        spec_line = format_spec_line(window)
        if spec_line is not None:
            logger.info(spec_line)


class _JSONRequest(Request):
    """Bodies parsed by pydantic-core's JSON reader: about 3x faster than `json.loads` on long id lists
    (a 14 MiB body of token ids: ~96 vs ~283 ms), time during which the event loop serves nobody."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = pydantic_core.from_json(body)
            except ValueError:
                # It refuses what `json.loads` takes (escaped lone surrogates, which then get a 400 that
                # names the field) and words errors less precisely: the slow reader has the last word.
                self._json = json.loads(body)
        return self._json


class _Route(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            return await handler(_JSONRequest(request.scope, request.receive))

        return route


# Endpoints are module-level and read the app's state: FastAPI caches facts about endpoint callables
# process-wide, so closures over one app's client kept every app's engine alive after shutdown.
router = APIRouter(route_class=_Route)


def _client(request: Request) -> EngineClient:
    return request.app.state.client


def _chat(request: Request) -> ChatServing:
    return request.app.state.chat


def _completions(request: Request) -> CompletionServing:
    return request.app.state.completions


def _tokenization(request: Request) -> TokenizationServing:
    return request.app.state.tokenization


@router.get("/health")
async def health(raw: Request) -> Response:
    client = _client(raw)
    if client.alive:
        return JSONResponse({"status": "ok"})
    reason = " (it stopped on an internal error: see the server log)" if client.error is not None else ""
    return APIError(503, f"the engine thread is not running{reason}", code="engine_dead").response()


@router.get("/version")
async def version() -> dict[str, Any]:
    return {"version": engine.__version__}


@router.get("/v1/models")
async def models(raw: Request) -> ModelList:
    client = _client(raw)
    loaded = client.core.loaded
    return ModelList(data=[ModelCard(id=name, root=loaded.path, max_model_len=client.max_model_len)
                           for name in client.served_model_names])


@router.post("/v1/chat/completions")
async def chat(req: ChatCompletionRequest, raw: Request) -> Response:
    return await _guard(raw, _chat(raw).create(req, raw))


@router.post("/v1/completions")
async def completions(req: CompletionRequest, raw: Request) -> Response:
    return await _guard(raw, _completions(raw).create(req, raw))


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, raw: Request) -> TokenizeResponse:
    return await _tokenization(raw).tokenize(req)


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, raw: Request) -> DetokenizeResponse:
    return await _tokenization(raw).detokenize(req)


@router.get("/metrics")
async def metrics(raw: Request) -> Response:
    return Response(_client(raw).metrics.render(), media_type=CONTENT_TYPE)


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Start the engine thread (and the stats log); stop it on shutdown."""
    client: EngineClient = app.state.client
    settings: ServerSettings = app.state.settings
    client.start()
    stats_task = None
    if settings.log_stats_interval > 0 and not settings.disable_log_stats:
        stats_task = asyncio.create_task(_log_stats(client, settings.log_stats_interval))
    try:
        yield
    finally:
        if stats_task is not None:
            stats_task.cancel()
        logger.info("shutting down the engine")
        await asyncio.to_thread(client.shutdown)


def build_app(settings: ServerSettings, client: EngineClient) -> FastAPI:
    """The app for an engine; its lifespan starts the engine thread and stops it on shutdown."""
    app = FastAPI(title="specserve", version=engine.__version__, lifespan=_lifespan)
    app.state.settings = settings
    app.state.client = client
    # `serving` holds what the endpoints share (tests and tools/bench_health.py read it too)
    serving = app.state.serving = OpenAIServing(client, settings)
    app.state.chat = ChatServing(serving)
    app.state.completions = CompletionServing(serving)
    app.state.tokenization = TokenizationServing(serving)
    install_error_handlers(app)
    app.add_middleware(GuardMiddleware, api_key=settings.api_key, max_body=settings.max_request_body_size)
    app.include_router(router)
    return app
