"""Start server command lines on loopback, wait until they serve, stop them; mlx_lm.server set-up.

Command lines may contain `{port}`; otherwise `--port N` is appended (and `--host 127.0.0.1` when no
host is given), which suits `specserve serve`, `vllm serve` and `mlx_lm.server` alike.
"""

from __future__ import annotations

import glob
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from loadtests.resources import ROOT

MLXLM_VENV = ROOT / ".venv-mlxlm"


@dataclass
class ServerSpec:
    label: str
    command: list[str] | None = None  # None: `url` points at a server someone else runs
    url: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    model: str | None = None  # the request's "model" field; None leaves it out
    startup_timeout_s: float = 300.0
    notes: dict[str, Any] = field(default_factory=dict)


def split_command(cmd: str | list[str]) -> list[str]:
    return shlex.split(cmd) if isinstance(cmd, str) else list(cmd)


def server_spec(label: str, value: str) -> ServerSpec:
    """`--server LABEL=VALUE`: VALUE is the URL of a running server, or a command line to start on
    loopback, optionally led by environment assignments as in a shell (`SPECSERVE_X=1 specserve serve`)."""
    if value.startswith(("http://", "https://")):
        return ServerSpec(label=label, url=value.rstrip("/"))
    words = split_command(value)
    env = {}
    while words and "=" in words[0] and words[0].split("=", 1)[0].isidentifier():
        name, val = words.pop(0).split("=", 1)
        env[name] = val
    if not words:
        raise ValueError(f"--server {label}=...: no command after the environment assignments")
    return ServerSpec(label=label, command=words, env=env)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """One server started from a command line; `with ServerProcess(spec, log) as srv: srv.url`."""

    def __init__(self, spec: ServerSpec, log_path: Path) -> None:
        self.spec = spec
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = spec.url or ""
        self.error: str | None = None
        self.startup_s: float | None = None
        self.cmd: list[str] | None = None  # the command line actually started

    def command(self, port: int) -> list[str]:
        cmd = [part.replace("{port}", str(port)) for part in split_command(self.spec.command or [])]
        if not any("{port}" in part for part in split_command(self.spec.command or [])):
            cmd += ["--port", str(port)]
        if "--host" not in cmd:
            cmd += ["--host", "127.0.0.1"]
        return cmd

    def start(self) -> bool:
        """Start and wait for /health (or /v1/models); False with `error` set when it does not come up."""
        if self.spec.command is None:
            return True
        port = free_port()
        cmd = self.cmd = self.command(port)
        self.url = f"http://127.0.0.1:{port}"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")  # noqa: SIM115 - the child writes to it until stop()
        log.write(f"$ {shlex.join(cmd)}\n".encode())
        log.flush()
        t0 = time.monotonic()
        # Own session: stop() can signal the server and any helper it forks, and nothing else.
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ,
                                     **self.spec.env}, start_new_session=True)
        log.close()
        deadline = t0 + self.spec.startup_timeout_s
        with httpx.Client(timeout=5) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    self.error = f"exited with status {self.proc.returncode}: {self.log_tail()}"
                    self.proc = None
                    return False
                for path in ("/health", "/v1/models"):
                    try:
                        if client.get(self.url + path).status_code == 200:
                            self.startup_s = time.monotonic() - t0
                            return True
                    except httpx.HTTPError:
                        pass
                time.sleep(0.5)
        self.error = f"not serving after {self.spec.startup_timeout_s:.0f} s: {self.log_tail()}"
        self.stop()
        return False

    def minor_faults(self) -> int | None:
        """The server process's minor page faults so far (Linux /proc), None where unknown. A server
        that keeps faulting (matrix.py flags over 10,000 a second) is stuck in malloc churn
        (engine/malloc.py), not comparable."""
        if self.proc is None:
            return None
        try:
            text = Path(f"/proc/{self.proc.pid}/stat").read_text()
        except OSError:
            return None
        return int(text.rsplit(")", 1)[1].split()[7])  # field 10 (minflt), after the command name

    def log_tail(self, lines: int = 3) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        # Progress bars use carriage returns: keep the last state of each line.
        rows = [ln.split("\r")[-1].strip() for ln in text.splitlines() if ln.strip()]
        errors = [r for r in rows if "error" in r.lower()]
        return errors[-1] if errors else " | ".join(rows[-lines:])

    def stop(self) -> None:
        if self.proc is None:
            return
        with_group = lambda sig: os.killpg(self.proc.pid, sig)  # type: ignore[union-attr]
        try:
            with_group(signal.SIGTERM)
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            with_group(signal.SIGKILL)
            self.proc.wait(10)
        except ProcessLookupError:
            pass
        self.proc = None

    def __enter__(self) -> ServerProcess:
        if not self.start():
            raise RuntimeError(f"{self.spec.label}: {self.error}")
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---------------------------------------------------------------------------------------------------
# Command lines for our server and for mlx_lm.server.

def specserve_command(spec_config: dict[str, Any] | None = None, max_model_len: int = 2048,
                      kv_cache_memory: str = "1GiB", extra: list[str] | None = None) -> list[str]:
    # This interpreter and the `server` package it imports: the same code as the harness's own.
    cmd = [sys.executable, "-m", "server.cli", "serve", "--max-model-len", str(max_model_len),
           "--kv-cache-memory", kv_cache_memory, "--disable-log-requests", "--log-stats-interval", "0"]
    if spec_config is not None:
        import json

        cmd += ["--speculative-config", json.dumps(spec_config)]
    return cmd + (extra or [])


def run_python(code: str, python: str | None = None, timeout: float = 600) -> str:
    """Run a snippet in a fresh interpreter (keeps mlx out of the load generator's process)."""
    out = subprocess.run([python or sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=timeout, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"python snippet failed: {out.stderr.strip()[-800:]}")
    return out.stdout.strip()


def ensure_mlxlm_venv(venv: Path = MLXLM_VENV) -> Path:
    """A side venv with mlx_lm (its own mlx); `mlx-lm[cpu]` because plain mlx-lm has no Linux backend."""
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import mlx_lm.server, mlx.core"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    print(f"installing mlx-lm into {venv} (once) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    extra = "mlx-lm[cpu]" if sys.platform == "linux" else "mlx-lm"
    subprocess.run([str(python), "-m", "pip", "install", "-q", extra], check=True)
    return python


def package_version(python: Path, pkg: str) -> str | None:
    try:
        return run_python(f"from importlib import metadata; print(metadata.version({pkg!r}))", str(python))
    except RuntimeError:
        return None


def ensure_float32_model() -> Path:
    """A float32, unquantized copy of the default model for servers that would otherwise run its 4-bit
    weights (mlx_lm on CPU is far slower quantized); specserve dequantizes to float32 the same way."""
    out = run_python("from loadtests.export_f32 import ensure_float32_copy\nprint(ensure_float32_copy())",
                     timeout=900)
    return Path(out.splitlines()[-1])


def mkl_library() -> str | None:
    """The optimized BLAS specserve loads (engine/blas.py), to give mlx_lm.server the same one."""
    hits = sorted(glob.glob(os.path.join(sys.prefix, "lib", "libmkl_rt.so*")))
    return hits[0] if hits and sys.platform == "linux" else None


def mlxlm_spec(label: str = "mlx_lm.server", same_blas: bool = True) -> ServerSpec:
    python = ensure_mlxlm_venv()
    model = ensure_float32_model()
    env: dict[str, str] = {}
    blas = "default"
    lib = mkl_library() if same_blas else None
    if lib:
        # libmlx takes cblas_* from the global scope: preloading gives it the BLAS specserve uses, so the
        # comparison is between servers, not between BLAS libraries.
        env["LD_PRELOAD"] = lib
        blas = lib
    cmd = [str(python), "-m", "mlx_lm.server", "--model", str(model)]
    return ServerSpec(label=label, command=cmd, env=env, notes={
        "mlx_lm_version": package_version(python, "mlx-lm"), "mlx_version": package_version(python, "mlx"),
        "model": str(model), "dtype": "float32", "blas": blas})
