"""`specserve serve` / `specserve prepare`: flags (one per settings field), --config YAML, the real CLI in a
subprocess (README examples run as written, clean SIGTERM shutdown)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

import httpx
import pytest
from pydantic import Field

import engine
import server.settings
from engine.config import EngineConfig, EngineOptions, Flag
from loadtests.servers import free_port
from server.cli import build_parser, main
from server.cli import serve as serve_cli
from server.cli.serve import flag_of, resolve_settings
from server.settings import ServerSettings
from specserve_configs import shipped
from tests.helpers import wait_healthy

ROOT = Path(__file__).resolve().parents[3]
SPECSERVE = str(Path(sys.executable).parent / "specserve")

ISSUE_FLAGS = ["--host", "--port", "--served-model-name", "--max-model-len", "--max-num-seqs",
               "--max-num-batched-tokens", "--block-size", "--dtype", "--kv-cache-memory",
               "--speculative-config", "--no-async-scheduling", "--api-key", "--seed", "--chat-template",
               "--log-level", "--uvicorn-log-level", "--disable-log-requests", "--config",
               "--max-waiting-requests", "--log-stats-interval", "--max-request-body-size"]


def parse(*argv: str, environ: dict[str, str] | None = None) -> ServerSettings:
    return resolve_settings(build_parser().parse_args(["serve", *argv]), environ or {})


def _serve_options(parser: Any = None) -> list[Any]:
    parser = parser or build_parser()
    serve = next(a for a in parser._actions if a.dest == "command").choices["serve"]
    return [a for a in serve._actions if a.option_strings and a.dest != "help"]


def test_help_documents_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in ISSUE_FLAGS:
        assert flag in text, flag
    assert "(default: 127.0.0.1)" in text and "(default: 8000)" in text
    options = _serve_options()
    assert len(options) >= 25
    for action in options:  # every option is described, not just named
        assert action.help and len(action.help) > 10, action.option_strings


def test_defaults_flags_and_env() -> None:
    s = parse()
    assert (s.host, s.port, s.model, s.api_key) == ("127.0.0.1", 8000, None, None)
    assert s.max_waiting_requests is None and s.max_request_body_size == 2 * 2**20
    s = parse("some/model", "--port", "9001", "--served-model-name", "a", "b", "--max-model-len", "1024",
              "--no-async-scheduling", "--no-enable-prefix-caching", "--kv-cache-memory", "256MiB",
              "--max-request-body-size", "1MiB", environ={"SPECSERVE_API_KEY": "from-env"})
    assert (s.model, s.port, s.served_model_name, s.max_model_len) == ("some/model", 9001, ["a", "b"], 1024)
    assert s.async_scheduling is False and s.enable_prefix_caching is False
    assert s.api_key == "from-env" and s.max_request_body_size == 2**20
    assert parse("--api-key", "flag", environ={"SPECSERVE_API_KEY": "env"}).api_key == "flag"


def test_config_file_with_flag_override(tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"port: 8100\nmax-model-len: 1024\nserved_model_name: smol\nchat-template: {template}\n"
                   "speculative-config:\n  method: ngram\n  num_speculative_tokens: 3\n")
    s = parse("--config", str(cfg), "--port", "8200")
    assert s.port == 8200 and s.max_model_len == 1024 and s.served_model_name == ["smol"]
    assert s.chat_template == template.read_text()
    assert s.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    from engine.config import EngineConfig

    engine_cfg = EngineConfig(**s.engine_config_kwargs())  # the engine parses the nested mapping
    assert engine_cfg.speculative_config.method == "ngram"
    assert engine_cfg.speculative_config.num_speculative_tokens == 3
    s = parse("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}')
    assert s.speculative_config["num_speculative_tokens"] == 2


@pytest.mark.parametrize(("yaml_text", "argv", "message"), [
    ("bogus-key: 1\n", [], "unknown key 'bogus-key'"),
    ("port: not-a-port\n", [], "port"),
    ("- a list\n", [], "mapping"),
    ("", ["--speculative-config", "{nope"], "not valid JSON"),
    ("", ["--chat-template", "/no/such/template.jinja"], "does not exist"),
    ("", ["--kv-cache-memory", "lots"], "kv_cache_memory"),
])
def test_invalid_settings_are_reported(tmp_path: Path, yaml_text: str, argv: list[str], message: str) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml_text)
    with pytest.raises(ValueError, match=re.escape(message)):
        parse("--config", str(cfg), *argv)


def test_model_flag_is_the_positional() -> None:
    assert parse("--model", "some/model").model == "some/model"
    assert parse("some/model", "--model", "some/model").model == "some/model"
    with pytest.raises(ValueError, match="two models given"):
        parse("a/model", "--model", "b/model")


def test_shipped_config_by_name_from_any_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no configs/ here
    s = parse("--config", "mtp")
    assistant = Path(s.speculative_config["model"])
    assert assistant == shipped("assistants", "smollm2-135m-mtp").resolve()
    assert (assistant / "model.safetensors").is_file()
    assert parse("--config", "mtp.yaml").speculative_config == s.speculative_config
    with pytest.raises(ValueError, match="shipped configs: .*mtp"):
        parse("--config", "no-such-config")


def test_config_paths_are_relative_to_its_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "cfg"
    (folder / "draft").mkdir(parents=True)
    (folder / "t.jinja").write_text("{{ messages[0].content }}")
    (folder / "c.yaml").write_text("model: HuggingFaceTB/SmolLM2-135M-Instruct\nchat-template: t.jinja\n"
                                   "speculative-config:\n  method: draft_model\n  model: draft\n"
                                   "  num_speculative_tokens: 2\n")
    monkeypatch.chdir(tmp_path)
    s = parse("--config", "cfg/c.yaml")
    assert s.model == "HuggingFaceTB/SmolLM2-135M-Instruct"  # no such folder beside the file: as written
    assert s.chat_template == "{{ messages[0].content }}"
    assert s.speculative_config["model"] == str((folder / "draft").resolve())


def test_version_is_the_installed_distribution(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert capsys.readouterr().out == f"specserve {version}\n"
    out = subprocess.run([sys.executable, "-m", "server.cli", "--version"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)  # how the tensor-parallel ranks are started
    assert out.returncode == 0 and out.stdout == f"specserve {version}\n", out.stderr
    assert engine.__version__ == version  # what /version answers


def _readme_examples(port: int) -> tuple[str, str]:
    """The curl and OpenAI SDK examples of README's "## HTTP API" section, pointed at `port`."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## HTTP API"):]
    section = section[: section.index("\n## ", 5)]
    blocks = re.findall(r"```(\w+)\n(.*?)```", section, flags=re.DOTALL)
    curl = next(code for lang, code in blocks if lang == "bash" and "curl " in code)
    sdk = next(code for lang, code in blocks if lang == "python" and "from openai import OpenAI" in code)
    return tuple(code.replace("localhost:8000", f"127.0.0.1:{port}") for code in (curl, sdk))  # type: ignore


@pytest.fixture
def serve_process(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, int, Path]]:
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("w") as f:
        proc = subprocess.Popen([SPECSERVE, "serve", "--port", str(port), "--max-model-len", "2048",
                                 "--kv-cache-memory", "512MiB", "--log-stats-interval", "1",
                                 "--shutdown-timeout", "2"],
                                stdout=f, stderr=subprocess.STDOUT, cwd=tmp_path,
                                env={**os.environ, "SPECSERVE_API_KEY": ""})
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", log, timeout=120)
        yield proc, port, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_serve_readme_examples_and_sigterm(serve_process: tuple[subprocess.Popen, int, Path]) -> None:
    proc, port, log = serve_process
    curl, sdk = _readme_examples(port)
    out = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=120, check=True)
    answer = json.loads(out.stdout)
    assert "Berlin" in answer["choices"][0]["message"]["content"]
    assert answer["model"] == "SmolLM2-135M-Instruct" and answer["usage"]["total_tokens"] > 0
    out = subprocess.run([sys.executable, "-c", sdk], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "Berlin" in lines[0] and "".join(lines[1:]).strip()  # the chat answer, then the streamed text
    busy = subprocess.run([SPECSERVE, "serve", "--port", str(port)], capture_output=True, text=True,
                          timeout=60)
    assert busy.returncode == 1 and "cannot listen" in busy.stderr  # before loading any model

    # SIGTERM while a stream is running: it gets a few seconds, then ends cleanly with an error event.
    events: list[str] = []
    body = {"prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True, "stream": True}

    def stream() -> None:
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as r:
            events.extend(line for line in r.iter_lines() if line.startswith("data: "))

    reader = threading.Thread(target=stream)
    reader.start()
    wait_until = time.monotonic() + 30
    while not events and time.monotonic() < wait_until:
        time.sleep(0.05)
    time.sleep(1.2)  # let a stats line be logged
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    reader.join(10)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["error"]["code"] == "aborted"
    assert len(events) > 5
    text = log.read_text()
    for expected in ("model SmolLM2-135M-Instruct", "dtype float32", "BLAS", "KV cache:",
                     "blocks x 16 tokens", f"http://127.0.0.1:{port}", "Avg generation throughput",
                     "shutting down the engine", "stopped"):
        assert expected in text, (expected, text)
    assert "Traceback" not in text


@pytest.mark.slow
def test_cli_ctrl_c_shuts_down_cleanly(serve_process: tuple[subprocess.Popen, int, Path]) -> None:
    proc, _, log = serve_process
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 0
    assert "stopped" in log.read_text() and "Traceback" not in log.read_text()


def test_cli_rejects_bad_speculative_config() -> None:
    bad = subprocess.run([SPECSERVE, "serve", "--speculative-config", "{not json"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "--speculative-config is not valid JSON" in bad.stderr
    bad = subprocess.run([SPECSERVE, "serve", "--speculative-config", '{"method": "ngram"}', "--port", "1"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "num_speculative_tokens" in bad.stdout + bad.stderr


def test_bad_platform_variable_is_a_clear_error() -> None:
    env = {**os.environ, "SPECSERVE_SMALL_GEMM": "maybe"}
    bad = subprocess.run([SPECSERVE, "serve", "--help"], capture_output=True, text=True, timeout=60, env=env)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "SPECSERVE_SMALL_GEMM='maybe': expected one of on, off" in bad.stderr


def test_cli_loads_no_mlx_before_platform_setup() -> None:
    # main() makes the process-wide choices (BLAS, malloc) first; they must come before MLX loads.
    probe = "import sys, server.cli; print('mlx.core' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]


def test_kv_layout_flag_reaches_the_engine_config() -> None:
    assert parse().engine_config_kwargs()["kv_layout"] == "auto"
    assert parse("--kv-layout", "block").engine_config_kwargs()["kv_layout"] == "block"


def test_every_flag_is_one_settings_field() -> None:
    fields = ServerSettings.model_fields
    dests = [a.dest for a in _serve_options() if a.dest not in ("model_flag", "config")]
    assert len(dests) == len(set(dests)) and set(dests) <= set(fields)
    for action in _serve_options():
        if action.dest in fields:
            assert action.option_strings[0] == "--" + action.dest.replace("_", "-")
    no_flag = {name for name, info in fields.items() if flag_of(info).hidden}
    assert set(fields) - set(dests) == {"model"} | no_flag  # MODEL: the positional and --model
    assert no_flag == {"fault_injection"}


def test_every_engine_option_reaches_the_engine_config() -> None:
    """Each engine option is declared once (EngineOptions): a ServerSettings field, a flag, an EngineConfig
    keyword; a value given as a flag arrives there as given."""
    assert set(EngineConfig.model_fields) - set(EngineOptions.model_fields) == {"show_progress"}
    assert set(parse().engine_config_kwargs()) == set(EngineOptions.model_fields)
    text = {"model": "some/model", "revision": "main", "kv_cache_memory": "256MiB",
            "chat_template": "{{ messages }}",
            "speculative_config": '{"method": "ngram", "num_speculative_tokens": 2}'}
    by_dest = {a.dest: a for a in _serve_options()}
    by_dest["model"] = by_dest.pop("model_flag")
    for name, info in EngineOptions.model_fields.items():
        action = by_dest.get(name)
        if action is None:
            assert flag_of(info).hidden, name
            continue
        flag = action.option_strings[0]
        if action.nargs == 0:  # a boolean: the other value
            argv = [f"--no-{flag[2:]}" if info.default else flag]
        elif action.choices:
            argv = [flag, next(c for c in reversed(action.choices) if c != info.default)]
        elif action.type in (int, float):
            argv = [flag, str(action.type((info.default or 16) * 2))]
        else:
            assert name in text, f"a sample value for {flag}"
            argv = [flag, text[name]]
        settings = parse(*argv)
        assert settings.engine_config_kwargs()[name] == getattr(settings, name) != info.default, argv
    EngineConfig(**parse("--speculative-config", text["speculative_config"]).engine_config_kwargs())


def test_a_new_field_becomes_a_flag_and_a_config_key(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    class Probe(ServerSettings):
        foo_bar: Literal["a", "b"] = Field("a", description="a throwaway choice")
        foo_count: Annotated[int | None, Flag(metavar="N")] = Field(None, ge=1, description="a count")
        foo_on: Annotated[bool, Flag(negatable=True)] = Field(True, description="a throwaway switch")

    monkeypatch.setattr(serve_cli, "ServerSettings", Probe)
    monkeypatch.setattr(server.settings, "ServerSettings", Probe)
    parser = build_parser()
    by_flag = {a.option_strings[0]: a for a in _serve_options(parser)}
    assert by_flag["--foo-bar"].choices == ["a", "b"] and "(default: a)" in by_flag["--foo-bar"].help
    assert by_flag["--foo-count"].type is int and by_flag["--foo-count"].metavar == "N"
    assert "--no-foo-on" in by_flag["--foo-on"].option_strings
    argv = ["serve", "--foo-bar", "b", "--foo-count", "3", "--no-foo-on"]
    s = resolve_settings(parser.parse_args(argv), {})
    assert (s.foo_bar, s.foo_count, s.foo_on) == ("b", 3, False)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("foo-count: 4\n")
    assert resolve_settings(parser.parse_args(["serve", "--config", str(cfg)]), {}).foo_count == 4
    with pytest.raises(ValueError, match="foo_count"):
        resolve_settings(parser.parse_args(["serve", "--foo-count", "0"]), {})


def test_prepare_prints_the_model_folder() -> None:
    from engine.models.loader import default_model_folder

    out = subprocess.run([SPECSERVE, "prepare"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert str(default_model_folder(progress=False)) in out.stdout
    assert "SmolLM2-135M-Instruct" in out.stdout
