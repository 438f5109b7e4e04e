"""Shared pytest fixtures (generic: any test file may use them).

HTTP server fixtures start the real specserve app (real engine, real default model, no mocks) under
uvicorn in a background thread, on a free port of 127.0.0.1:

- `make_server(**settings)`: a context manager factory. `with make_server(api_key="k") as srv:` starts a
  server with those `server.settings.ServerSettings` overrides (defaults below keep memory small) and
  yields a `RunningServer`; it stops (engine thread included) when the block exits. All servers share
  one loaded default model, so each start costs well under a second.
- `server` (session scope): one shared `RunningServer` with the defaults (max_model_len 2048, 512 MiB
  KV cache). Tests must leave it idle (no request left running).
- `server_url`: `server.url` (e.g. "http://127.0.0.1:41234"; the OpenAI base URL is `server.base_url`).

`RunningServer.client` is the app's `EngineClient` (`.core` is the `EngineCore`: inspect
`core.kv.num_free_blocks`, `core.scheduler.running`, ...), `.app` the FastAPI app.
Server-related imports happen inside the fixtures so other test files do not pay for them.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

SERVER_DEFAULTS: dict[str, Any] = {
    "max_model_len": 2048,
    "kv_cache_memory": "512MiB",
    "log_stats_interval": 0,
    "disable_log_requests": True,
}


@dataclass
class RunningServer:
    url: str
    app: Any  # fastapi.FastAPI
    client: Any  # server.engine_client.EngineClient
    settings: Any  # server.settings.ServerSettings

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    @property
    def core(self) -> Any:
        return self.client.core

    def kv_pool_full(self) -> bool:
        kv = self.core.kv
        return kv.num_free_blocks == kv.pool.num_blocks

    def idle(self) -> bool:
        sched = self.core.scheduler
        return not sched.running and not sched.waiting and self.kv_pool_full()


@contextlib.contextmanager
def run_server(loaded: Any = None, **overrides: Any) -> Iterator[RunningServer]:
    import uvicorn

    from server.app import build_app
    from server.engine_client import create_engine_client
    from server.settings import ServerSettings

    settings = ServerSettings(**{**SERVER_DEFAULTS, **overrides})
    client = create_engine_client(settings, loaded=loaded, show_progress=False)
    app = build_app(settings, client)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))  # our own socket: no race for the free port
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2)
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield RunningServer(url=f"http://127.0.0.1:{port}", app=app, client=client, settings=settings)
    finally:
        srv.should_exit = True
        thread.join(30)
        sock.close()
        client.shutdown()


@pytest.fixture(scope="session")
def default_loaded_model() -> Any:
    """The default model (float32), loaded once per session and shared with tests/helpers.py."""
    from tests.helpers import default_model

    return default_model()


@pytest.fixture(scope="session")
def make_server(default_loaded_model: Any) -> Callable[..., contextlib.AbstractContextManager[RunningServer]]:
    def factory(**overrides: Any) -> contextlib.AbstractContextManager[RunningServer]:
        return run_server(default_loaded_model, **overrides)

    return factory


@pytest.fixture(scope="session")
def server(make_server: Callable[..., contextlib.AbstractContextManager[RunningServer]]) -> Iterator[
        RunningServer]:
    with make_server() as srv:
        yield srv


@pytest.fixture(scope="session")
def server_url(server: RunningServer) -> str:
    return server.url
