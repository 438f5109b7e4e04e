"""`--generation-config auto|vllm|FOLDER` and `--override-generation-config JSON` (vLLM's flags): a model's
generation_config.json sampling defaults fill the fields a request leaves out; a field the client sent wins.

The model folder here is the default model's files (symlinks) plus a generation_config.json whose effect
shows: greedy (temperature 0, top_k 1), repetition_penalty 1.3 and 7 tokens when max_tokens is omitted.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.models.loader import generation_defaults, model_folder
from server.cli import main
from server.cli.serve import resolve_settings
from server.protocol import ChatCompletionRequest, CompletionRequest
from tests.conftest import run_server

GEN = {"temperature": 0.0, "top_k": 1, "repetition_penalty": 1.3, "max_new_tokens": 7,
       "do_sample": True, "bos_token_id": 1, "eos_token_id": 2}  # the last three are not sampling defaults
FROM_GEN = {"temperature": 0.0, "top_k": 1, "repetition_penalty": 1.3, "max_tokens": 7}
CHAT = [{"role": "user", "content": "Count from 1 to 20, separated by commas."}]
EXPLICIT = {"temperature": 0.0, "top_k": 1, "repetition_penalty": 1.3}


def _parse(*argv: str) -> Any:
    from server.cli import build_parser

    return resolve_settings(build_parser().parse_args(["serve", *argv]), {})


def _write(folder: Path, config: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's files, linked into a folder with our own generation_config.json."""
    from engine.models.loader import default_model_folder

    folder = tmp_path_factory.mktemp("model")
    for f in default_model_folder(progress=False).iterdir():
        if f.name != "generation_config.json":
            (folder / f.name).symlink_to(f)
    return _write(folder, GEN)


@pytest.fixture(scope="module")
def folder_model(model_dir: Path) -> Any:
    """The model loaded from that folder, as `specserve serve FOLDER` loads it (once for the module)."""
    from engine.models.loader import load_model

    return load_model(str(model_dir), dtype="float32", progress=False)


def _server(loaded: Any, **settings: Any) -> Any:
    return run_server(loaded, max_model_len=64, **settings)


def _params(srv: Any, body: dict[str, Any]) -> Any:
    """The SamplingParams the serving layer builds for a request body (no generation)."""
    req = ChatCompletionRequest(**body) if "messages" in body else CompletionRequest(**body)
    return srv.app.state.serving.sampling_params(req, None)[0]


# -- reading the defaults ----------------------------------------------------------------------------


def test_keys_taken_as_vllm_takes_them(tmp_path: Path) -> None:
    extra = {"min_p": 0.05, "presence_penalty": 0.5, "frequency_penalty": 0.25}
    _write(tmp_path, {**GEN, "top_p": None, **extra})
    assert generation_defaults("auto", tmp_path) == {**FROM_GEN, **extra}
    assert generation_defaults("vllm", tmp_path) == {}
    (tmp_path / "m.gguf").write_bytes(b"")  # a GGUF file: its folder's generation_config.json
    assert model_folder(tmp_path / "m.gguf") == tmp_path
    assert generation_defaults("auto", tmp_path / "m.gguf")["max_tokens"] == 7
    (tmp_path / "bare").mkdir()
    assert generation_defaults("auto", tmp_path / "bare") == {}  # no file: OpenAI's defaults stay
    other = _write(tmp_path / "other", {"temperature": 0.6})
    assert generation_defaults(str(other), tmp_path) == {"temperature": 0.6}
    # the override merges on top; a null in it drops the file's default, as in vLLM
    merged = generation_defaults("auto", tmp_path, {"temperature": 0.8, "max_new_tokens": None, "top_p": 0.9})
    assert merged == {"temperature": 0.8, "top_k": 1, "top_p": 0.9, "min_p": 0.05,
                      "presence_penalty": 0.5, "frequency_penalty": 0.25, "repetition_penalty": 1.3}
    assert generation_defaults("vllm", tmp_path, {"top_k": 20}) == {"top_k": 20}


def test_bad_files_and_values(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "generation_config.json").write_text("{nope")
    with caplog.at_level(logging.WARNING):
        assert generation_defaults("auto", tmp_path) == {}  # the model's own unreadable file: ignored
    assert "cannot read it as JSON" in caplog.text
    with pytest.raises(ValueError, match="cannot read it as JSON"):
        generation_defaults(str(tmp_path), tmp_path)  # a folder named on purpose: an error
    _write(tmp_path, {"temperature": -1})
    with pytest.raises(ValueError, match=r"generation_config.json \(--generation-config vllm ignores it\): "
                                         r"temperature must be >= 0"):
        generation_defaults("auto", tmp_path)
    _write(tmp_path, {"max_new_tokens": 0})
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        generation_defaults("auto", tmp_path)


# -- flags and the config file -----------------------------------------------------------------------


def test_flags_and_config_file(tmp_path: Path) -> None:
    assert _parse().generation_config == "auto" and _parse().override_generation_config is None
    assert _parse("--generation-config", "vllm").generation_config == "vllm"
    folder = _write(tmp_path / "gen", {"temperature": 0.5})
    assert _parse("--generation-config", str(folder)).generation_config == str(folder)
    s = _parse("--override-generation-config", '{"temperature": 0.5, "max_new_tokens": 9}')
    assert s.override_generation_config == {"temperature": 0.5, "max_new_tokens": 9}
    cfg = tmp_path / "serve.yaml"  # a relative folder in a config file is taken from the file's folder
    cfg.write_text("generation-config: gen\noverride_generation_config:\n  top_k: 20\n")
    s = _parse("--config", str(cfg))
    assert s.generation_config == str(folder.resolve()) and s.override_generation_config == {"top_k": 20}
    cfg.write_text("generation-config: vllm\n")
    assert _parse("--config", str(cfg), "--generation-config", "auto").generation_config == "auto"


@pytest.mark.parametrize(("argv", "message"), [
    (["--override-generation-config", "{nope"], "--override-generation-config is not valid JSON"),
    (["--override-generation-config", '{"temprature": 0.5}'],
     "--override-generation-config: unknown key(s) temprature"),
    (["--override-generation-config", '{"top_p": 2}'],
     "--override-generation-config: top_p must be in (0, 1]"),
    (["--generation-config", "bogus"], "--generation-config 'bogus': expected auto, vllm or a folder"),
])
def test_bad_flags_stop_the_start(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


# -- the server --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def auto_server(folder_model: Any, model_dir: Path) -> Iterator[Any]:
    with _server(folder_model, model=str(model_dir)) as srv:
        yield srv


def _chat(srv: Any, **fields: Any) -> dict[str, Any]:
    r = httpx.post(f"{srv.base_url}/chat/completions", json={"messages": CHAT, **fields}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_auto_applies_the_model_defaults_over_http(auto_server: Any) -> None:
    omitted = _chat(auto_server)
    assert omitted["usage"]["completion_tokens"] == 7 and omitted["choices"][0]["finish_reason"] == "length"
    greedy = _chat(auto_server, max_tokens=7, **EXPLICIT)
    assert omitted["choices"][0]["message"]["content"] == greedy["choices"][0]["message"]["content"]
    assert _params(auto_server, {"prompt": "1, 2, 3,"}).max_tokens == 7  # not OpenAI's 16


def test_request_values_win(auto_server: Any) -> None:
    sent = {"temperature": 0.9, "top_k": 0, "repetition_penalty": 1.0, "max_tokens": 3, "top_p": 0.5}
    p = _params(auto_server, {"messages": CHAT, **sent})
    assert (p.temperature, p.top_k, p.repetition_penalty, p.max_tokens, p.top_p) == (0.9, 0, 1.0, 3, 0.5)
    assert _params(auto_server, {"messages": CHAT, "max_completion_tokens": 4}).max_tokens == 4
    assert _params(auto_server, {"prompt": "x", "top_k": 0}).top_k == 0  # a sent 0 is no omission


def test_default_max_tokens_fits_the_context(auto_server: Any) -> None:
    """A default max_tokens is shortened to the room a prompt leaves; the same number sent is refused."""
    prompt = [100] * 60  # max_model_len 64: room for 4
    url = f"{auto_server.base_url}/completions"
    r = httpx.post(url, json={"prompt": prompt}, timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    r = httpx.post(url, json={"prompt": prompt, "max_tokens": 7}, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_vllm_ignores_the_file(folder_model: Any, model_dir: Path) -> None:
    with _server(folder_model, model=str(model_dir), generation_config="vllm") as srv:
        p = _params(srv, {"messages": CHAT})
        assert (p.temperature, p.top_k, p.repetition_penalty, p.max_tokens) == (1.0, 0, 1.0, None)
        assert _params(srv, {"prompt": "x"}).max_tokens == 16


def test_folder_and_override(folder_model: Any, model_dir: Path, tmp_path: Path,
                             caplog: pytest.LogCaptureFixture) -> None:
    """A FOLDER's generation_config.json replaces the model's own; the override goes over it."""
    other = _write(tmp_path / "gen", {"temperature": 0.5, "top_p": 0.9, "max_new_tokens": 5})
    with caplog.at_level(logging.INFO, logger="server.serving"), _server(
            folder_model, model=str(model_dir), generation_config=str(other),
            override_generation_config={"top_k": 3, "min_p": 0.1}) as srv:
        p = _params(srv, {"messages": CHAT})
        assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == (
            0.5, 0.9, 3, 0.1, 1.0, 5)
    line = next(r.getMessage() for r in caplog.records if "sampling defaults" in r.getMessage())
    assert re.search(r"temperature=0\.5, top_p=0\.9, top_k=3, min_p=0\.1, max_tokens=5 \(from "
                     r"--generation-config \S+ and --override-generation-config", line), line


def test_the_default_model_keeps_openai_defaults() -> None:
    from engine.models.loader import default_model_folder

    assert generation_defaults("auto", default_model_folder(progress=False)) == {}


def test_offline_llm_defaults(folder_model: Any) -> None:
    from tests.helpers import make_llm

    llm = make_llm(loaded=folder_model, max_model_len=256, kv_cache_memory="64MiB")
    assert llm.get_default_sampling_params().max_tokens == 7
    out = llm.generate("1, 2, 3,")[0]
    assert len(out.token_ids) == 7
    assert make_llm(loaded=folder_model, max_model_len=256, kv_cache_memory="64MiB",
                    generation_config="vllm").get_default_sampling_params().temperature == 1.0
