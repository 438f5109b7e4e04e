"""`specserve serve [MODEL]` and `specserve prepare [MODEL]`.

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
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import Any

import uvicorn

from engine import platform
from engine.cpu.build import isa_status
from engine.cpu.threads import configure as configure_threads
from server.settings import ServerSettings
from specserve_configs import server_configs

logger = logging.getLogger("specserve")

API_KEY_ENV = "SPECSERVE_API_KEY"

# (flag, settings field, argparse options). Booleans with a vLLM "--no-x" spelling use
# BooleanOptionalAction, so both spellings exist.
_SERVE_FLAGS: list[tuple[str, str, dict[str, Any]]] = [
    ("--host", "host", {}),
    ("--port", "port", {"type": int}),
    ("--served-model-name", "served_model_name", {"nargs": "+", "metavar": "NAME"}),
    ("--revision", "revision", {}),
    ("--dtype", "dtype", {"choices": ["auto", "float32", "float16", "bfloat16"]}),
    ("--quantization", "quantization", {"choices": ["q8", "q4"]}),
    ("--activation-precision", "activation_precision", {"choices": ["auto", "int8", "float32"]}),
    ("--max-model-len", "max_model_len", {"type": int}),
    ("--max-num-seqs", "max_num_seqs", {"type": int}),
    ("--max-num-batched-tokens", "max_num_batched_tokens", {"type": int}),
    ("--block-size", "block_size", {"type": int}),
    ("--kv-cache-memory", "kv_cache_memory", {"metavar": "SIZE"}),
    ("--enable-prefix-caching", "enable_prefix_caching", {"action": argparse.BooleanOptionalAction}),
    ("--attention-backend", "attention_backend", {"choices": ["auto", "metal", "cpu", "reference"]}),
    ("--kv-layout", "kv_layout", {"choices": ["auto", "block", "head"]}),
    ("--cpu-threads", "cpu_threads", {"type": int, "metavar": "N"}),
    ("--speculative-config", "speculative_config", {"metavar": "JSON"}),
    ("--speculative-disable-by-batch-size", "speculative_disable_by_batch_size", {"type": int}),
    ("--per-request-spec-decode-metrics", "per_request_spec_decode_metrics", {"choices": ["off", "summary"]}),
    ("--async-scheduling", "async_scheduling", {"action": argparse.BooleanOptionalAction}),
    ("--seed", "seed", {"type": int}),
    ("--generation-config", "generation_config", {"metavar": "auto|vllm|FOLDER"}),
    ("--override-generation-config", "override_generation_config", {"metavar": "JSON"}),
    ("--chat-template", "chat_template", {"metavar": "FILE"}),
    ("--trust-remote-code", "trust_remote_code", {"action": "store_true"}),
    ("--trust-request-chat-template", "trust_request_chat_template", {"action": "store_true"}),
    ("--default-chat-template-kwargs", "default_chat_template_kwargs", {"metavar": "JSON"}),
    ("--chat-template-timeout", "chat_template_timeout", {"type": float, "metavar": "SECONDS"}),
    ("--enable-auto-tool-choice", "enable_auto_tool_choice", {"action": "store_true"}),
    ("--tool-call-parser", "tool_call_parser", {"metavar": "NAME"}),
    ("--reasoning-parser", "reasoning_parser", {"metavar": "NAME"}),
    ("--max-prompt-chars", "max_prompt_chars", {"type": int}),
    ("--preprocess-threads", "preprocess_threads", {"type": int}),
    ("--api-key", "api_key", {"metavar": "KEY"}),
    ("--max-waiting-requests", "max_waiting_requests", {"type": int}),
    ("--max-request-body-size", "max_request_body_size", {"metavar": "SIZE"}),
    ("--max-n", "max_n", {"type": int}),
    ("--max-stop-strings", "max_stop_strings", {"type": int}),
    ("--max-stop-chars", "max_stop_chars", {"type": int}),
    ("--max-stop-token-ids", "max_stop_token_ids", {"type": int}),
    ("--request-timeout", "request_timeout", {"type": float, "metavar": "SECONDS"}),
    ("--shutdown-timeout", "shutdown_timeout", {"type": float, "metavar": "SECONDS"}),
    ("--tensor-parallel-size", "tensor_parallel_size", {"type": int}),
    ("--hostfile", "hostfile", {"metavar": "FILE"}),
    ("--replicas", "replicas", {"type": int}),
    ("--max-replicas", "max_replicas", {"type": int}),
    ("--ray-address", "ray_address", {"metavar": "ADDRESS"}),
    ("--replica-cpus", "replica_cpus", {"type": float}),
    ("--replica-routing", "replica_routing", {"choices": ["prefix", "power-of-two"]}),
    ("--log-level", "log_level", {"choices": ["debug", "info", "warning", "error", "critical"]}),
    ("--uvicorn-log-level", "uvicorn_log_level",
     {"choices": ["critical", "error", "warning", "info", "debug", "trace"]}),
    ("--disable-log-requests", "disable_log_requests", {"action": "store_true"}),
    ("--log-stats-interval", "log_stats_interval", {"type": float, "metavar": "SECONDS"}),
    ("--disable-log-stats", "disable_log_stats", {"action": "store_true"}),
    ("--step-trace", "step_trace", {"metavar": "FILE"}),
]


def _help(field: str) -> str:
    info = ServerSettings.model_fields[field]
    text = info.description or ""
    default = info.default
    if default is not None and default is not False and not isinstance(default, bool):
        text += f" (default: {default})"
    elif default is True:
        text += " (default: on)"
    return text.replace("%", "%%")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description="OpenAI-compatible LLM server on MLX.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True,
                                metavar="{serve,prepare,train-assistant,train-draft,bench}")

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
    for flag, field, opts in _SERVE_FLAGS:
        serve.add_argument(flag, dest=field, default=argparse.SUPPRESS, help=_help(field), **opts)

    prepare = sub.add_parser("prepare", help="download / convert a model once and print where it is",
                             description="Load MODEL once (the default model is converted into the cache "
                                         "folder), print where it is, and exit.")
    prepare.add_argument("model", nargs="?", default=None,
                         help="HF folder, GGUF file or Hub id (default: SmolLM2-135M-Instruct)")
    prepare.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    prepare.add_argument("--revision", default=None)
    prepare.add_argument("--quantization", default=None, choices=["q8", "q4"],
                         help="write a quantized copy (mlx-lm's converter, affine, group 64) and print it")
    prepare.add_argument("--out", default=None,
                         help="folder for the quantized copy (default: <cache>/models/NAME-qN-mlx)")

    # Numeric training flags default to None: the defaults live in TrainSettings / DraftSettings.
    train = sub.add_parser("train-assistant", help="self-distil an MTP assistant for MODEL (method: mtp)",
                           description="The target writes its own training text, then a small assistant "
                                       "learns its next-next token on MLX. Resumable: rerun to continue.")
    train.add_argument("--model", default=None, help="target (default: SmolLM2-135M-Instruct)")
    train.add_argument("--out", required=True, help="output folder (checkpoint/ and data/ go inside)")
    train.add_argument("--prompts", default=None, help="JSONL of {\"prompt\": ...} (default: configs/)")
    train.add_argument("--steps", type=int, help="training steps")
    train.add_argument("--max-prompts", type=int, help="prompts used from the set (0: all)")
    train.add_argument("--mix-sampled", action="store_true",
                       help="answer odd prompts with sampling (default: greedy only, as drafting sees)")
    train.add_argument("--head-size", type=int, help="reduced vocabulary of the head")
    train.add_argument("--intermediate-size", type=int,
                       help="MLP width of the assistant's layer (default: a sixth of the target's)")
    train.add_argument("--max-tokens", type=int, help="tokens generated per answer")
    train.add_argument("--seed", type=int)
    train.add_argument("--answer-only", action="store_true",
                       help="score answer positions only (default: every position)")
    draft = sub.add_parser("train-draft", help="distil a small draft model for MODEL (method: draft_model)",
                           description="The target's first layers, trained on the text the target writes "
                                       "itself. Resumable: rerun to continue.")
    draft.add_argument("--model", default=None, help="target (default: SmolLM2-135M-Instruct)")
    draft.add_argument("--out", required=True, help="output folder (a Hugging Face-layout model)")
    draft.add_argument("--data", default=None,
                       help="reuse generated text: a sequences.jsonl written by train-assistant/train-draft")
    draft.add_argument("--prompts", default=None, help="JSONL of {\"prompt\": ...} (default: configs/)")
    draft.add_argument("--num-layers", type=int, help="target layers the draft keeps")
    draft.add_argument("--steps", type=int, help="training steps")
    draft.add_argument("--max-prompts", type=int, help="prompts used from the set (0: all)")
    draft.add_argument("--max-tokens", type=int, help="tokens generated per answer")
    draft.add_argument("--seed", type=int)

    from loadtests.cli import add_parser as add_bench_parser

    add_bench_parser(sub)
    return parser


def _normalize_key(key: str) -> str:
    return key.strip().lstrip("-").replace("-", "_")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("specserve")
    except PackageNotFoundError:  # a checkout run with `python -m server.cli`, never installed
        return "(not installed)"


def config_file(name: str) -> Path:
    """--config's file: a path, or where no such file exists and no folder is named, a shipped config
    (`mtp` or `mtp.yaml`)."""
    path = Path(name).expanduser()
    shipped = server_configs()
    if not path.exists() and path.name == name and path.stem in shipped and path.suffix in ("", ".yaml"):
        return shipped[path.stem]
    return path


def _paths_from(folder: Path, values: dict[str, Any]) -> None:
    """A relative path naming a file to read is taken from the config file's folder where it exists there
    (the shipped MTP config names its assistant so); otherwise it stays as written (a Hub id, a path
    from the working directory)."""
    spec = values.get("speculative_config")
    slots = [(values, "model"), (values, "chat_template")]
    if values.get("generation_config") not in ("auto", "vllm"):
        slots.append((values, "generation_config"))
    if isinstance(spec, dict):
        slots.append((spec, "model"))
    for where, key in slots:
        value = where.get(key)
        if isinstance(value, str) and value and not Path(value).expanduser().is_absolute():
            beside = folder / value
            if beside.exists():
                where[key] = str(beside.resolve())


def load_config_file(name: str) -> dict[str, Any]:
    import yaml

    path = config_file(name)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        missing = isinstance(e, FileNotFoundError)
        hint = f" (shipped configs: {', '.join(server_configs())})" if missing else ""
        raise ValueError(f"--config {path}: {e.strerror}{hint}") from e
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: invalid YAML: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values")
    known = set(ServerSettings.model_fields)
    out = {}
    for key, value in data.items():
        key_name = _normalize_key(str(key))
        if key_name not in known:
            raise ValueError(f"--config {path}: unknown key {key!r}")
        out[key_name] = value
    _paths_from(path.parent, out)
    return out


def resolve_settings(args: argparse.Namespace, environ: dict[str, str] | None = None) -> ServerSettings:
    """File < environment (API key) < command line. Raises ValueError with a readable message."""
    from pydantic import ValidationError

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
    for key in ("speculative_config", "default_chat_template_kwargs", "override_generation_config"):
        if isinstance(values.get(key), str):
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


def _setup_logging(level: str) -> None:
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
    import mlx.core as mx

    from server.app import build_app
    from server.engine_client import create_engine_client

    _setup_logging(settings.log_level)
    if settings.replicas > 1 or settings.max_replicas is not None:
        return serve_replicas(settings)
    from engine.distributed import launched_rank

    if settings.tensor_parallel_size > 1 and launched_rank() is not None:
        from server.tensor_parallel import note_rank0_pid, run_follower

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
                mx.__version__, mx.default_device(), isa_status(),
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
    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host
    logger.info("serving on http://%s:%d (OpenAI API at http://%s:%d/v1)", host, port, host, port)
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
    try:
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


def prepare(model: str | None, dtype: str, revision: str | None, quantization: str | None = None,
            out: str | None = None) -> int:
    from engine.models.loader import load_model, quantized_copy

    _setup_logging("info")
    try:
        if quantization:
            folder = quantized_copy(model, quantization, revision, dtype, out)
            print(f"{model} ({quantization}) is ready at {folder}")
            return 0
        loaded = load_model(model, dtype=dtype, revision=revision, progress=True)  # type: ignore[arg-type]
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"specserve prepare: {e}", file=sys.stderr)
        return 1
    print(f"{loaded.name} is ready at {loaded.path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        platform.setup()  # before anything imports mlx
    except (ValueError, RuntimeError) as e:  # a bad SPECSERVE_* value
        print(f"specserve: {e}", file=sys.stderr)
        return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "prepare":
        return prepare(args.model, args.dtype, args.revision, args.quantization, args.out)
    if args.command == "train-assistant":
        from engine.training.assistant import main_cli

        return main_cli(args)
    if args.command == "train-draft":
        from engine.training.draft import main_cli as draft_cli

        return draft_cli(args)
    if args.command == "bench":
        from loadtests.cli import run as bench

        return bench(args)
    try:
        settings = resolve_settings(args)
    except ValueError as e:
        parser.exit(2, f"specserve serve: error: {e}\n")
    from engine.distributed import launched_rank

    if settings.tensor_parallel_size > 1 and launched_rank() is None:
        from server.tensor_parallel import launch

        _setup_logging(settings.log_level)
        try:
            return launch(settings, list(argv) if argv is not None else sys.argv[1:])
        except (ValueError, FileNotFoundError) as e:
            logger.error("cannot start the ranks: %s", e)
            return 2
    return serve(settings)


if __name__ == "__main__":
    sys.exit(main())
