"""Start the ranks of one model and supervise them: on one machine with MLX's ring-backend environment and
each rank's own cores, across machines through MLX's launcher; a signal stops rank 0 gracefully, and a rank
that ends early stops the rest (docs/scale-out.md)."""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType

logger = logging.getLogger("specserve.tp")

# Where rank 0 writes its pid under MLX's launcher: a signal to the launcher would kill the ranks' output.
PIDFILE_ENV = "SPECSERVE_TP_PIDFILE"
_POLL_S = 0.2
_RANKS_GRACE_S = 15.0  # after rank 0 ends, the others get this long before they are killed


def launched_rank() -> int | None:
    """This process's rank when a launcher started it (MLX_RANK), else None."""
    rank = os.environ.get("MLX_RANK")
    return int(rank) if rank is not None else None


def launch(cmd: list[str], size: int, hostfile: str | None, grace_s: float) -> int:
    """Start `size` ranks of `cmd` (each takes its part from MLX_RANK), here or with MLX's launcher over
    `hostfile`, and wait; -> the exit status. `grace_s`: how long rank 0 may take to stop."""
    with tempfile.TemporaryDirectory(prefix="specserve-tp-") as tmp:
        pidfile = Path(tmp) / "rank0.pid"
        if hostfile is not None:
            procs = [_start_with_mlx_launch(hostfile, cmd, pidfile)]
        else:
            procs = _start_local(size, cmd, Path(tmp))
        return _supervise(procs, grace_s, pidfile)


def _start_local(n: int, cmd: list[str], tmp: Path) -> list[subprocess.Popen[bytes]]:
    hostfile = tmp / "ring.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in _free_ports(n)]))
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    share = max(1, len(cpus) // n) if cpus else max(1, (os.cpu_count() or 1) // n)
    procs = []
    for rank in range(n):
        env = dict(os.environ, MLX_RANK=str(rank), MLX_HOSTFILE=str(hostfile), SPECSERVE_TP_BACKEND="ring")
        env.setdefault("OMP_NUM_THREADS", str(share))
        # Each rank on its own cores: threads sharing a core wait a scheduler tick at every all-sum.
        mine = cpus[rank * share : (rank + 1) * share] if len(cpus) >= n else []
        procs.append(subprocess.Popen(cmd, env=env, preexec_fn=_child_setup(mine),  # noqa: PLW1509
                                      start_new_session=True))
    logger.info("started %d tensor-parallel ranks on this machine (ring backend, %s)", n,
                f"{share} core(s) each" if cpus else "no core pinning")
    return procs


def _start_with_mlx_launch(hostfile: str, cmd: list[str], pidfile: Path) -> subprocess.Popen[bytes]:
    launcher = shutil.which("mlx.launch", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                               os.environ.get("PATH", "")]))
    if launcher is None:
        raise FileNotFoundError("mlx.launch (MLX's launcher) is not installed next to this Python")
    logger.info("starting the ranks of %s with MLX's launcher", hostfile)
    try:
        data = json.loads(Path(hostfile).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--hostfile {hostfile}: {e}") from e
    # Each rank must join the backend the launcher sets up (not the first that starts).
    backend = data.get("backend", "") if isinstance(data, dict) else ""
    env = ["--env", f"{PIDFILE_ENV}={pidfile}"]
    if backend in ("ring", "mpi", "jaccl"):
        env += ["--env", f"SPECSERVE_TP_BACKEND={backend}"]
    return subprocess.Popen([launcher, "--hostfile", hostfile, *env, "--", *cmd], start_new_session=True,
                            stdin=subprocess.DEVNULL)


def _child_setup(cpus: list[int]):  # noqa: ANN202 - a preexec_fn
    def setup() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)
        _die_with_parent()
    return setup


def _die_with_parent() -> None:
    """Linux: the rank gets SIGTERM if the supervisor dies, so that no rank outlives it."""
    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def note_rank0_pid() -> None:
    """Rank 0 under MLX's launcher: tell the supervisor (on this machine) where to send a stop."""
    path = os.environ.get(PIDFILE_ENV)
    if path:
        with contextlib.suppress(OSError):  # rank 0 on another machine
            Path(path).write_text(str(os.getpid()))


def _supervise(procs: list[subprocess.Popen[bytes]], grace_s: float, pidfile: Path) -> int:
    """Wait for the ranks (or MLX's launcher); a signal stops rank 0 gracefully. -> rank 0's status, or the
    first failed rank's."""
    stopping: list[float] = []

    def stop_rank0() -> None:
        try:
            os.kill(int(pidfile.read_text()), signal.SIGTERM)
        except (OSError, ValueError):
            _signal(procs[0], signal.SIGTERM)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if not stopping:
            stopping.append(time.monotonic())
            stop_rank0()

    original = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        status: int | None = None
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            if status is None and codes[0] is not None:
                status = codes[0]
                stopping.append(time.monotonic())
            elif status is None and not stopping and any(c is not None for c in codes):
                i = next(i for i, c in enumerate(codes) if c is not None)
                # A follower never ends on its own while rank 0 serves.
                status = codes[i] or 1
                logger.error("tensor-parallel rank %d ended (status %s); stopping the others", i, codes[i])
                stop_rank0()
                stopping.append(time.monotonic())
            if stopping and time.monotonic() - stopping[0] > grace_s + _RANKS_GRACE_S:
                for p in procs:
                    _signal(p, signal.SIGKILL)
            time.sleep(_POLL_S)
        if status is None or status == 0:
            status = procs[0].returncode
        return status if status >= 0 else 128 - status
    finally:
        for sig, handler in original.items():
            signal.signal(sig, handler)


def _signal(p: subprocess.Popen[bytes], sig: int) -> None:
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, sig)
