"""What `pip install .` installs: every package folder, the files the code reads (configs/ as the package
`specserve_configs`, loadtests/data), nothing that imports tools/; and (slow, run by .ci/run) a wheel
installed into a fresh venv that serves the shipped MTP config from outside the checkout."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import httpx
import pytest
from setuptools import find_packages

from loadtests.servers import ServerProcess, ServerSpec

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]
PACKAGES: list[str] = SETUPTOOLS["packages"]
PACKAGE_DIR: dict[str, str] = SETUPTOOLS["package-dir"]


def _folder(package: str) -> Path:
    top, _, rest = package.partition(".")
    return ROOT / PACKAGE_DIR.get(top, top) / rest.replace(".", "/")


def test_every_package_folder_is_installed() -> None:
    found = set(find_packages(str(ROOT), exclude=["tests", "tests.*", "tools", "tools.*"]))
    mapped = {folder.replace("/", "."): name for name, folder in PACKAGE_DIR.items()}
    expected = {mapped.get(p, p) for p in found}
    assert set(PACKAGES) == expected, ("[tool.setuptools] packages in pyproject.toml must list every "
                                       f"package folder: missing {sorted(expected - set(PACKAGES))}, "
                                       f"extra {sorted(set(PACKAGES) - expected)}")
    assert not any(p == "tools" or p.startswith("tools.") for p in PACKAGES)


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_installed_code_never_imports_tools_or_tests() -> None:
    offenders = []
    for package in PACKAGES:
        for path in _folder(package).glob("*.py"):
            bad = {m for m in _imported_modules(path) if m.split(".")[0] in ("tools", "tests")}
            if bad:
                offenders.append(f"{path.relative_to(ROOT)}: {sorted(bad)}")
    assert not offenders


@pytest.mark.parametrize("package", ["loadtests", "specserve_configs"])
def test_package_data_covers_the_data_folders(package: str) -> None:
    folder = _folder(package)
    declared = {p for pattern in PYPROJECT["tool"]["setuptools"]["package-data"][package]
                for p in folder.glob(pattern) if p.is_file()}
    data_dirs = {"loadtests": ["data"], "specserve_configs": ["assistants"]}[package]
    wanted = {p for d in data_dirs for p in (folder / d).rglob("*")
              if p.is_file() and "__pycache__" not in p.parts}
    wanted |= {p for p in folder.glob("*") if p.suffix in (".yaml", ".jsonl")}
    assert wanted and wanted <= declared, sorted(str(p.relative_to(ROOT)) for p in wanted - declared)


# -- a wheel in a fresh venv ----------------------------------------------------------------------------

_BUILD_JUNK = shutil.ignore_patterns(".git", ".venv*", "results", "build", "dist", "*.egg-info",
                                     "__pycache__", ".pytest_cache", ".ruff_cache")


def _run(*cmd: str | Path, cwd: Path, env: dict[str, str] | None = None, timeout: float = 300) -> str:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _fresh_venv(tmp: Path) -> Path:
    """A venv holding only the wheel built from a copy of this checkout. Its dependencies come from the
    running venv through a .pth path line (no network); that line does not run the running venv's own
    .pth files, so an editable install there stays invisible."""
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=_BUILD_JUNK)
    pip = [sys.executable, "-m", "pip", "-q"]
    _run(*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", tmp / "dist", src, cwd=tmp)
    (wheel,) = (tmp / "dist").glob("specserve-*.whl")
    venv = tmp / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp)
    python = venv / "bin" / "python"
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(_run(python, "-c", purelib, cwd=tmp).strip())
    deps = dict.fromkeys(p for p in sys.path if Path(p).name in ("site-packages", "dist-packages"))
    (site / "_specserve_test_deps.pth").write_text("".join(f"{d}\n" for d in deps))
    _run(*pip, "--python", python, "install", "--no-deps", "--no-index", wheel, cwd=tmp)
    return venv


@pytest.mark.slow
def test_wheel_in_a_fresh_venv_serves_the_shipped_mtp_config(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    venv = _fresh_venv(tmp_path)
    work = tmp_path / "elsewhere"  # not the checkout: nothing may come from the working directory
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    python, specserve = venv / "bin" / "python", venv / "bin" / "specserve"

    where = json.loads(_run(python, "-c", (
        "import json, engine, server, loadtests, metal_kernels, specserve_configs, importlib.util\n"
        "from loadtests.datasets import load_dataset\n"
        "print(json.dumps({'modules': [m.__file__ for m in (engine, server, loadtests, metal_kernels, "
        "specserve_configs)], 'workloads': {w: len(load_dataset(w)) for w in ('chat', 'copy', 'long')}, "
        "'tools': importlib.util.find_spec('tools') is not None}))"), cwd=work, env=env))
    site = venv.resolve()
    assert all(Path(f).resolve().is_relative_to(site) for f in where["modules"]), where["modules"]
    assert all(n > 0 for n in where["workloads"].values()) and not where["tools"], where
    version = PYPROJECT["project"]["version"]
    assert _run(specserve, "--version", cwd=work, env=env).strip() == f"specserve {version}"

    monkeypatch.chdir(work)
    spec = ServerSpec("wheel", [str(specserve), "serve", "--config", "mtp", "--max-model-len", "1024",
                                "--kv-cache-memory", "256MiB"], env={"PYTHONPATH": ""}, startup_timeout_s=600)
    log = tmp_path / "serve.log"
    with ServerProcess(spec, log) as srv:
        model = httpx.get(f"{srv.url}/v1/models").json()["data"][0]["id"]
        r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=300, json={
            "model": model, "max_tokens": 24, "temperature": 0,
            "messages": [{"role": "user", "content": "Count from one to ten in words."}]})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"].strip()
        assert httpx.get(f"{srv.url}/version").json() == {"version": version}
        metrics = httpx.get(f"{srv.url}/metrics").text
        drafted = [float(line.split()[-1]) for line in metrics.splitlines()
                   if line.startswith("vllm:spec_decode_num_draft_tokens_total")]
        assert drafted and drafted[0] > 0, "the MTP assistant drafted nothing"
    # The assistant came from the installed package, not from a checkout.
    assert "site-packages/specserve_configs/assistants/smollm2-135m-mtp" in log.read_text(), log.read_text()
