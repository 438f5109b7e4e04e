"""`specserve serve [MODEL]`: the flags, built from ServerSettings' fields, and the HTTP server.

Flags carry vLLM's names. `--config FILE.yaml` takes the same keys (dashes or underscores; the
speculative config as a nested mapping); flags given on the command line win over the file.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import types
from collections.abc import Callable, Generator, Sequence
from typing import Any, Literal, Union, get_args, get_origin

import uvicorn
from pydantic import ValidationError
from pydantic.fields import FieldInfo

from engine import platform
from engine.config import Flag
from engine.cpu.build import isa_status
from engine.cpu.threads import configure as configure_threads
from engine.tensor_parallel.launcher import launched_rank, note_rank0_pid
from server.settings import ServerSettings, load_config_file
from server.tensor_parallel import launch, run_follower
from specserve_configs import server_configs

logger = logging.getLogger("specserve")

API_KEY_ENV = "SPECSERVE_API_KEY"


def flag_of(info: FieldInfo) -> Flag:
    """The field's Flag metadata (engine.config.Flag), or the default one."""
    return next((m for m in info.metadata if isinstance(m, Flag)), Flag())


def flag_options(info: FieldInfo) -> dict[str, Any] | None:
    """argparse keywords for a settings field's flag, or None where it has none. The type, choices, nargs
    and action follow from the field's type; the help and its default from the field."""
    flag = flag_of(info)
    if flag.hidden:
        return None
    kinds = [info.annotation]
    if get_origin(info.annotation) in (Union, types.UnionType):
        kinds = [t for t in get_args(info.annotation) if t is not type(None)]
    kind = kinds[0] if len(kinds) == 1 else str  # several types (sizes): the field parses the text
    opts: dict[str, Any] = {"help": _help(info)}
    if flag.metavar:
        opts["metavar"] = flag.metavar
    if kind is bool:
        opts["action"] = argparse.BooleanOptionalAction if flag.negatable else "store_true"
    elif get_origin(kind) is Literal:
        opts["choices"] = list(get_args(kind))
    elif get_origin(kind) is list:
        opts["nargs"] = "+"
    elif kind in (int, float) and not flag.text:
        opts["type"] = kind
    return opts


def _help(info: FieldInfo) -> str:
    text = info.description or ""
    default = info.default
    if default is not None and default is not False and not isinstance(default, bool):
        text += f" (default: {default})"
    elif default is True:
        text += " (default: on)"
    return text.replace("%", "%%")


def add_parser(sub: Any) -> argparse.ArgumentParser:
    serve = sub.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve MODEL over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
                    "/v1/models, /tokenize, /detokenize, /health, /version, /metrics).",
        epilog=f"Every flag can also be set in --config FILE.yaml. {API_KEY_ENV} sets --api-key.")
    # SUPPRESS: only flags actually given appear, so they can override the YAML file.
    serve.add_argument("model", nargs="?", default=argparse.SUPPRESS,
                       help=ServerSettings.model_fields["model"].description)
    serve.add_argument("--model", dest="model_flag", metavar="MODEL", default=argparse.SUPPRESS,
                       help="the same as the positional MODEL (vLLM's spelling)")
    serve.add_argument("--config", metavar="FILE.yaml", default=argparse.SUPPRESS,
                       help="YAML file with the same keys as the flags (e.g. `max-model-len: 2048`), or the "
                            f"name of a shipped one ({', '.join(server_configs())})")
    for name, info in ServerSettings.model_fields.items():
        opts = flag_options(info)
        if name != "model" and opts is not None:  # MODEL is the positional and --model above
            serve.add_argument(f"--{name.replace('_', '-')}", dest=name, default=argparse.SUPPRESS, **opts)
    return serve


def resolve_settings(args: argparse.Namespace, environ: dict[str, str] | None = None) -> ServerSettings:
    """File < environment (API key) < command line. Raises ValueError with a readable message."""
    environ = dict(os.environ) if environ is None else environ
    given = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    flag = given.pop("model_flag", None)
    if flag is not None:
        if given.get("model", flag) != flag:
            raise ValueError(f"two models given: {given['model']!r} and --model {flag!r}")
        given["model"] = flag
    values: dict[str, Any] = load_config_file(args.config) if getattr(args, "config", None) else {}
    if "api_key" not in values and environ.get(API_KEY_ENV):
        values["api_key"] = environ[API_KEY_ENV]
    values.update(given)
    for key, info in ServerSettings.model_fields.items():
        if flag_of(info).metavar == "JSON" and isinstance(values.get(key), str):
            try:
                values[key] = json.loads(values[key])
            except json.JSONDecodeError as e:
                raise ValueError(f"--{key.replace('_', '-')} is not valid JSON: {e}") from e
    try:
        return ServerSettings(**values)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'settings'}: {err['msg']}"
                             for err in e.errors())
        raise ValueError(problems) from None


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """`specserve serve`, parsed from `argv` into `args`."""
    try:
        settings = resolve_settings(args)
    except ValueError as e:
        sys.stderr.write(f"specserve serve: error: {e}\n")  # as argparse reports a bad flag
        sys.exit(2)
    if settings.tensor_parallel_size > 1 and launched_rank() is None:
        setup_logging(settings.log_level)
        try:
            return launch(settings, argv)
        except (ValueError, FileNotFoundError) as e:
            logger.error("cannot start the ranks: %s", e)
            return 2
    return serve(settings)


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", force=True)


def _bind(host: str, port: int) -> socket.socket:
    """Bind before loading the model, so a busy port fails at once rather than after the load."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    return sock


def serve(settings: ServerSettings) -> int:
    # These import MLX, which must load after platform.setup() (server.cli.main).
    import mlx.core as mx

    from server.app import build_app
    from server.engine_client import create_engine_client

    setup_logging(settings.log_level)
    if settings.replicas > 1 or settings.max_replicas is not None:
        return serve_replicas(settings)
    if settings.tensor_parallel_size > 1 and launched_rank() is not None:
        if launched_rank():
            return run_follower(settings)
        note_rank0_pid()
    try:
        sock = _bind(settings.host, settings.port)
    except OSError as e:
        logger.error("cannot listen on %s:%d: %s", settings.host, settings.port, e.strerror or e)
        return 1
    host = platform.setup()
    blas = host.blas
    threads = configure_threads(settings.cpu_threads)
    if settings.async_scheduling:
        logger.warning("--async-scheduling is ignored: the engine schedules synchronously")
    try:
        client = create_engine_client(settings)
    except (ValueError, FileNotFoundError) as e:
        logger.error("cannot start: %s", e)
        sock.close()
        return 2
    core = client.core
    loaded = core.loaded
    logger.info("model %s (%s), served as %s, dtype %s, max_model_len %d", loaded.name, loaded.path,
                ", ".join(client.served_model_names), str(loaded.dtype).removeprefix("mlx.core."),
                core.max_model_len)
    logger.info("backend: mlx %s on %s, C kernels %s (threads: %s), BLAS %s%s, small-M GEMM %s, malloc %s",
                mx.__version__, mx.default_device(), isa_status(),  # type: ignore[attr-defined]  # stub gap
                threads.fixed or f"up to {threads.cpus}, fewer beside busy processes", blas.name,
                f" ({blas.path})" if blas.path else f" ({blas.reason})", blas.small_gemm, host.malloc)
    logger.info("KV cache: %d blocks x %d tokens = %d tokens", core.kv.pool.num_blocks, core.kv.block_size,
                core.kv.pool.num_blocks * core.kv.block_size)
    if settings.speculative_config:
        logger.info("speculative decoding: %s", json.dumps(settings.speculative_config))
    if settings.api_key:
        logger.info("API key required (all endpoints but /health and /metrics)")
    try:
        app = build_app(settings, client)
    except ValueError as e:  # the chat template or its default kwargs do not fit the model
        logger.error("cannot start: %s", e)
        sock.close()
        return 2
    addr, port = sock.getsockname()[:2]
    addr = f"[{addr}]" if ":" in addr else addr
    logger.info("serving on http://%s:%d (OpenAI API at http://%s:%d/v1)", addr, port, addr, port)
    config = uvicorn.Config(app, log_level=settings.uvicorn_log_level,
                            access_log=not settings.disable_log_requests,
                            timeout_graceful_shutdown=int(settings.shutdown_timeout) + 2)
    server = _Server(config, on_shutdown=client.abort_all, grace_s=settings.shutdown_timeout)
    client.exit_hook = server.exit_with  # a dead engine stops the process for a supervisor to restart it
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    logger.info("stopped" if server.exit_code == 0 else f"stopped with status {server.exit_code}")
    return server.exit_code
class _Server(uvicorn.Server):
    """uvicorn with three changes for a clean stop:

    - after a signal, requests still running --shutdown-timeout seconds later are aborted, so their
      clients get a proper end (an error event and `data: [DONE]`) before uvicorn's own timeout cancels them;
    - uvicorn re-raises SIGINT/SIGTERM after its graceful shutdown (a traceback for Ctrl-C, a kill for
      SIGTERM); we shut down the same way and then exit 0;
    - `exit_with(code)`: the engine died, so the server stops and the process exits non-zero.
    """

    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], object] | None = None,
                 grace_s: float = 3.0) -> None:
        super().__init__(config)
        self._on_shutdown = on_shutdown
        self._grace_s = grace_s
        self.exit_code = 0

    def exit_with(self, code: int) -> None:
        """Stop serving and make `serve` return `code` (any thread). Should the stop hang, the process
        exits hard once the grace period and uvicorn's own timeout are over."""
        self.exit_code = code
        self.should_exit = True
        timer = threading.Timer(self._grace_s + 10.0, os._exit, (code,))
        timer.daemon = True
        timer.start()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self._on_shutdown is not None:
            asyncio.get_running_loop().call_later(self._grace_s, self._on_shutdown)
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def serve_replicas(settings: ServerSettings) -> int:
    """Engine replicas behind Ray Serve's HTTP proxy, on a Ray cluster this starts (or joins)."""
    try:  # Ray is an optional extra
        import ray
        from ray import serve as ray_serve

        from server.replicas import build
    except ImportError as e:
        logger.error("--replicas needs Ray Serve: pip install 'specserve[ray]' (%s)", e)
        return 2
    joined = bool(settings.ray_address or os.environ.get("RAY_ADDRESS"))
    if not joined:  # a joined cluster's Serve proxy may hold the port already
        try:
            _bind(settings.host, settings.port).close()  # fail before starting a cluster, not after
        except OSError as e:
            logger.error("cannot listen on %s:%d: %s", settings.host, settings.port, e.strerror or e)
            return 1
    ray.init(address=settings.ray_address, include_dashboard=False, logging_level=logging.WARNING,
             configure_logging=False)
    stop = threading.Event()
    started = False

    def on_signal(*_: object) -> None:
        stop.set()
        if not started:  # still deploying (serve.run waits for the replicas): stop waiting
            raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    try:
        ray_serve.start(http_options={"host": settings.host, "port": settings.port})
        ray_serve.run(build(settings), name="specserve", route_prefix="/")
        started = True
        logger.info("serving %d replica(s) on http://%s:%d (OpenAI API at /v1)", settings.replicas,
                    settings.host, settings.port)
        while not stop.wait(1.0):
            pass
    except RuntimeError as e:  # a replica that cannot start (bad model, bad settings) fails the deploy
        logger.error("cannot start: %s", e)
        return 2
    except KeyboardInterrupt:
        logger.info("stopping before the replicas were up")
    finally:
        # On a cluster of its own everything stops; on a shared one only this application does (Serve
        # and its HTTP proxy stay up for the others, on the address they were started with). Bounded:
        # a SIGTERM sent to the whole process group (a supervisor's stop) has killed the local cluster's
        # processes too, and Serve would wait for them forever.
        stopper = threading.Thread(target=(lambda: ray_serve.delete("specserve")) if joined else
                                   ray_serve.shutdown, daemon=True)
        stopper.start()
        stopper.join(settings.shutdown_timeout + 10)
        ray.shutdown()  # a local cluster's processes end with it
    logger.info("stopped")
    return 0
