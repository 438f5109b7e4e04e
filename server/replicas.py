"""Engine replicas on Ray Serve (`specserve serve --replicas N`, or `serve run server.replicas:app_builder`):
an `Ingress`, a `PrefixAwareRouter` over `EngineReplica`s that each run the single-engine app, and a
`MetricsBoard` (docs/scale-out.md). FastAPI reads the ingress annotations at run time (no `from __future__
import annotations`), and Serve serialises the ingress where it is decorated: what it calls is above it."""

import asyncio
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from engine import platform
from server.errors import error_body
from server.metrics import CONTENT_TYPE, merge_expositions
from server.routing import PrefixTable, route_key
from server.settings import ServerSettings

logger = logging.getLogger("specserve")

RETRY_AFTER_S = 1
# Failures that say "another replica (or this one, restarted) can take it": the client retries.
RETRYABLE = (RayActorError, BackPressureError, DeploymentUnavailableError)
ROUTED_PATHS = ("/v1/chat/completions", "/v1/completions")
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]
# Each push is a Ray call and a render: every few seconds keeps them cheap beside small engines (a
# Prometheus scrape interval is 15 s).
METRICS_PUSH_S = 5.0
METRICS_STALE_S = 30.0


def _unavailable(message: str) -> JSONResponse:
    return JSONResponse(error_body(message, "server_error", None, "replica_unavailable"), status_code=503,
                        headers={"Retry-After": str(RETRY_AFTER_S)})


class PrefixAwareRouter(RequestRouter):
    """The replica whose prefix record holds the longest prefix of the request's key, unless its queue is
    `imbalanced_threshold` requests longer than the shortest; else the least loaded (Serve probes queue
    lengths within a rank and takes the shortest)."""

    # Serve passes request_router_kwargs as keywords: the documented way to narrow the base's **kwargs.
    def initialize_state(self, imbalanced_threshold: int = 4,  # type: ignore[override]
                         capacity: int = 65536) -> None:
        self.imbalanced_threshold = imbalanced_threshold
        self.table = PrefixTable(capacity)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        available = self.select_available_replicas(candidate_replicas) or candidate_replicas
        chain = _chain_of(pending_request)
        if chain:
            by_id = {r.replica_id: r for r in available}
            best, covered = self.table.best(by_id, chain)
            if best is not None and covered > 0 and not self._imbalanced(best, available):
                rest = [r for r in available if r.replica_id != best]
                return [[by_id[best]], rest] if rest else [[by_id[best]]]
        return [available]

    def _imbalanced(self, best: ReplicaID, replicas: list[RunningReplica]) -> bool:
        cache = self.replica_queue_len_cache
        lens = {r.replica_id: cache.get(r.replica_id) for r in replicas}
        known = [q for q in lens.values() if q is not None]
        mine = lens.get(best)
        return mine is not None and bool(known) and mine - min(known) > self.imbalanced_threshold

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        chain = _chain_of(pending_request)
        if chain:
            self.table.insert(replica_id, chain)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.table.keep_only(r.replica_id for r in replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.table.drop(replica_id)


def _chain_of(pending_request: PendingRequest | None) -> list[tuple[bytes, int]]:
    if pending_request is None or not pending_request.args:
        return []
    first = pending_request.args[0]
    return first.get("route_key") or [] if isinstance(first, dict) else []


@serve.deployment(num_replicas=1, max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0},
                  logging_config={"enable_access_log": False})
class MetricsBoard:
    """The latest /metrics exposition of every replica, pushed by the replicas themselves."""

    def __init__(self) -> None:
        self._texts: dict[str, tuple[float, bytes]] = {}

    def put(self, replica: str, text: bytes) -> None:
        self._texts[replica] = (time.monotonic(), text)

    def collect(self) -> dict[str, bytes]:
        now = time.monotonic()
        for r in [r for r, (t, _) in self._texts.items() if now - t > METRICS_STALE_S]:
            del self._texts[r]  # a replica that stopped pushing is gone
        return {r: text for r, (_, text) in self._texts.items()}


class _ASGIDriver:
    """Runs one HTTP request through an in-process ASGI app; its response comes back as a first item
    {status, headers, body} and then body chunks (whatever the app sent meanwhile, joined)."""

    def __init__(self, app: Any, req: dict[str, Any]) -> None:
        self.app = app
        self.req = req
        self.queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self.disconnected = asyncio.Event()
        self._body_sent = False

    async def receive(self) -> dict[str, Any]:
        if not self._body_sent:
            self._body_sent = True
            return {"type": "http.request", "body": self.req["body"], "more_body": False}
        await self.disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.queue.put_nowait(message)

    def scope(self) -> dict[str, Any]:
        r = self.req
        return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": r["method"],
                "scheme": "http", "path": r["path"], "raw_path": r["path"].encode(), "root_path": "",
                "query_string": r["query"].encode(), "headers": r["headers"], "client": r.get("client"),
                "server": None, "state": {}}

    async def run(self) -> AsyncIterator[Any]:
        task = asyncio.create_task(self.app(self.scope(), self.receive, self.send))
        task.add_done_callback(lambda _: self.queue.put_nowait(None))
        first: dict[str, Any] | None = None
        started = False
        try:
            while True:
                msgs = [await self.queue.get()]
                while not self.queue.empty():
                    msgs.append(self.queue.get_nowait())
                chunks = []
                done = False
                for m in msgs:
                    if m is None:
                        done = True
                    elif m["type"] == "http.response.start":
                        first = {"status": m["status"], "headers": [(bytes(k), bytes(v)) for k, v in
                                                                    m.get("headers", [])]}
                    elif m["type"] == "http.response.body":
                        chunks.append(bytes(m.get("body", b"")))
                        done |= not m.get("more_body", False)  # the response is complete
                if first is not None and not started:
                    # `done`: the whole response is here (a JSON body): the caller need not ask for more.
                    yield {**first, "body": b"".join(chunks), "done": done}
                    started = True  # later items are bytes
                elif any(chunks):
                    yield b"".join(chunks)
                if done:
                    break
            if task.done():
                task.result()  # the app's own exception, if it raised
        finally:
            self.disconnected.set()  # the client went away (or the response is over): the app aborts
            if not task.done():
                await asyncio.wait({task}, timeout=30)


@serve.deployment(max_ongoing_requests=256, health_check_period_s=5, health_check_timeout_s=30,
                  logging_config={"enable_access_log": False})
class EngineReplica:
    """One engine and the whole single-engine app, in this replica's process."""

    # Serve awaits an async constructor (mypy requires __init__ to return None).
    async def __init__(self, settings: dict[str, Any],  # type: ignore[misc]
                       board: DeploymentHandle | None = None) -> None:
        platform.setup()  # before MLX is imported
        # These import MLX: here, after platform.setup(), in the replica's own process.
        from server.app import build_app
        from server.engine_client import create_engine_client

        parsed = ServerSettings(**settings)
        self.client = create_engine_client(parsed, show_progress=False)
        self.app = build_app(parsed, self.client)
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()
        self.name = serve.get_replica_context().replica_id.unique_id
        self.board = board
        self._push = asyncio.create_task(self._push_metrics()) if board is not None else None
        logger.info("replica %s: engine up (%d KV blocks)", self.name, self.client.core.kv.pool.num_blocks)

    async def handle(self, req: dict[str, Any]) -> AsyncIterator[Any]:
        async for item in _ASGIDriver(self.app, req).run():
            yield item

    async def _push_metrics(self) -> None:
        assert self.board is not None
        while True:
            try:
                await self.board.put.remote(self.name, self.client.metrics.render())
            except Exception as e:  # noqa: BLE001 - the board restarts; metrics wait for it
                logger.debug("metrics push failed: %s", e)
            await asyncio.sleep(METRICS_PUSH_S)

    def check_health(self) -> None:
        if not self.client.alive:
            raise RuntimeError(f"the engine thread is not running: {self.client.error!r}")

    async def __del__(self) -> None:
        push = getattr(self, "_push", None)
        if push is not None:
            push.cancel()
        if hasattr(self, "_lifespan"):  # the constructor got that far
            await self._lifespan.__aexit__(None, None, None)


def _key(path: str, body: bytes) -> list[tuple[bytes, int]]:
    try:
        return route_key(path, json.loads(body))
    except (ValueError, RecursionError):
        return []


async def _first_or_disconnect(gen: DeploymentResponseGenerator, request: Request) -> dict[str, Any] | None:
    """The replica's first reply, or None when the client leaves first. Serve cancels this handler when
    its proxy sees the client go: then the replica's request is cancelled too."""
    first = asyncio.ensure_future(gen.__anext__())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({first, gone}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # cancelled with the handler
        gen.cancel()
        raise
    finally:
        for task in (first, gone):
            if not task.done():
                task.cancel()
                task.add_done_callback(_retrieve)  # its cancellation error is expected
    if first.done() and not first.cancelled():
        return first.result()
    gen.cancel()
    return None


def _retrieve(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


async def _disconnected(request: Request) -> None:
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:  # noqa: BLE001 - the proxy's channel failed: that is not the client leaving
        await asyncio.Event().wait()


async def _rest(gen: DeploymentResponseGenerator, head: bytes, sse: bool) -> AsyncIterator[bytes]:
    if head:
        yield head
    try:
        async for chunk in gen:
            yield chunk
    except RETRYABLE as e:
        # Mid-response there is no status to change: a stream ends with an error event, a body just ends.
        logger.warning("a replica failed mid-response: %s", type(e).__name__)
        if sse:
            body = error_body("the replica serving this request failed mid-stream; retry", "server_error",
                              None, "replica_unavailable")
            yield f"data: {json.dumps(body)}\n\n".encode()
    finally:
        gen.cancel()


ingress_app = FastAPI(title="specserve (replicas)", openapi_url=None, docs_url=None, redoc_url=None)


@serve.deployment(max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0},
                  logging_config={"enable_access_log": False})
@serve.ingress(ingress_app)
class Ingress:
    """Forwards every HTTP request to an engine replica, chosen by the prefix-aware router."""

    def __init__(self, engine: DeploymentHandle, board: DeploymentHandle, max_body: int) -> None:
        self.engine = engine.options(stream=True)
        self.board = board
        self.max_body = max_body

    @ingress_app.get("/metrics")
    async def metrics(self) -> Response:
        texts = await self.board.collect.remote()
        return Response(merge_expositions(texts), media_type=CONTENT_TYPE)

    @ingress_app.api_route("/{path:path}", methods=METHODS)
    async def forward(self, path: str, request: Request) -> Response:
        body = await self._read_body(request)
        req: dict[str, Any] = {
            "method": request.method, "path": request.url.path, "query": request.url.query,
            "headers": [(k, v) for k, v in request.headers.raw], "body": body,
            "client": tuple(request.client) if request.client else None, "route_key": []}
        if request.method == "POST" and request.url.path in ROUTED_PATHS and len(body) <= self.max_body:
            req["route_key"] = _key(request.url.path, body)
        gen = cast(DeploymentResponseGenerator, self.engine.handle.remote(req))  # a stream=True handle
        try:
            first = await _first_or_disconnect(gen, request)
        except RETRYABLE as e:
            logger.warning("request failed on a replica, client told to retry: %s", type(e).__name__)
            return _unavailable("the replica serving this request is unavailable; retry")
        if first is None:  # the client left before the response started
            return Response(status_code=499)
        headers = dict((k.decode("latin-1"), v.decode("latin-1")) for k, v in first["headers"])
        if first["done"]:
            return Response(first["body"], status_code=first["status"], headers=headers)
        headers.pop("content-length", None)
        sse = headers.get("content-type", "").startswith("text/event-stream")
        return StreamingResponse(_rest(gen, first["body"], sse), status_code=first["status"], headers=headers)

    async def _read_body(self, request: Request) -> bytes:
        """At most one byte more than the limit: the replica's guard refuses an oversized body (413)."""
        parts, size = [], 0
        async for chunk in request.stream():
            parts.append(chunk)
            size += len(chunk)
            if size > self.max_body:
                break
        return b"".join(parts)[: self.max_body + 1]


def build(settings: Any) -> serve.Application:
    """The Serve application for `settings` (a ServerSettings): `replicas` engines (autoscaling up to
    `max_replicas` when requests wait), routed by `replica_routing`."""
    replicas, max_replicas = settings.replicas, settings.max_replicas
    data = settings.model_dump(exclude={"replicas", "max_replicas", "ray_address", "replica_routing",
                                        "replica_cpus"})
    # Ray gives a worker OMP_NUM_THREADS = the CPUs it reserves (1 when it reserves none), and the BLAS
    # and the C kernels read it: reserving a share of the cores is what gives an engine its threads.
    cpus = settings.replica_cpus or (os.cpu_count() or 1) / max(replicas, max_replicas or 1)
    options: dict[str, Any] = {"ray_actor_options": {"num_cpus": cpus}}
    if max_replicas is not None and max_replicas > replicas:
        # Requests beyond max_num_seqs wait in a replica's queue: scale when they do.
        options["autoscaling_config"] = {"min_replicas": replicas, "max_replicas": max_replicas,
                                         "initial_replicas": replicas,
                                         "target_ongoing_requests": settings.max_num_seqs}
    else:
        options["num_replicas"] = replicas
    if settings.replica_routing == "prefix":
        options["request_router_config"] = {"request_router_class": PrefixAwareRouter}
    # @serve.deployment made these classes Deployments; mypy does not apply class decorators.
    board = MetricsBoard.bind()  # type: ignore[attr-defined]
    engine = EngineReplica.options(**options).bind(data, board)  # type: ignore[attr-defined]
    return Ingress.bind(engine, board, settings.max_request_body_size)  # type: ignore[attr-defined]


def app_builder(args: dict[str, Any]) -> serve.Application:
    """For `serve run server.replicas:app_builder key=value ...` and Serve config files: the keys are
    `specserve serve`'s settings (snake_case), plus `replicas`, `max_replicas` and `replica_routing`."""
    return build(ServerSettings(**{k.replace("-", "_"): v for k, v in args.items()}))
