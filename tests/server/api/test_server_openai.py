"""The OpenAI-compatible endpoints through the official `openai` client, against a real server."""

from __future__ import annotations

import asyncio
import functools

import httpx
import openai
import pytest

from engine.sampling import SamplingParams
from tests.conftest import RunningServer
from tests.helpers import make_llm

MODEL = "SmolLM2-135M-Instruct"
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]
PROMPTS = ["The capital of France is", "Once upon a time, there was a"]


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def aclient(server: RunningServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


@functools.cache
def _offline() -> tuple[tuple[str, ...], tuple[str, ...], tuple[int, ...], tuple[int, ...]]:
    """Greedy outputs of the offline engine (engine.llm.LLM) for QUESTIONS (chat) and PROMPTS."""
    llm = make_llm()
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    chats = llm.generate([llm.apply_chat_template(_chat(q)) for q in QUESTIONS], greedy)
    comps = llm.generate(PROMPTS, greedy)
    return (tuple(o.text for o in chats), tuple(o.text for o in comps),
            tuple(len(o.token_ids) for o in chats), tuple(len(o.token_ids) for o in comps))


def _chat(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


def test_greedy_over_http_equals_offline_engine(server: RunningServer, aclient: openai.AsyncOpenAI) -> None:
    chat_texts, comp_texts, chat_lens, comp_lens = _offline()

    async def run() -> tuple[list, list]:
        chats = [aclient.chat.completions.create(model=MODEL, messages=_chat(q), max_tokens=16, temperature=0)
                 for q in QUESTIONS]
        comps = [aclient.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0)
                 for p in PROMPTS]
        results = await asyncio.gather(*chats, *comps)  # concurrent: batched in the engine
        return results[: len(chats)], results[len(chats):]

    chats, comps = asyncio.run(run())
    for resp, text, n in zip(chats, chat_texts, chat_lens, strict=True):
        assert resp.choices[0].message.content == text
        assert resp.usage.completion_tokens == n
    for resp, text, n in zip(comps, comp_texts, comp_lens, strict=True):
        assert resp.choices[0].text == text
        assert resp.usage.completion_tokens == n
    assert server.idle()


def test_chat_non_streaming_shape(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=[
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                     {"type": "text", "text": " of France?"}]}], max_completion_tokens=12,
        temperature=0, user="tester")
    assert resp.id.startswith("chatcmpl-") and resp.object == "chat.completion" and resp.model == MODEL
    assert resp.created > 1_600_000_000
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    u = resp.usage
    assert u.prompt_tokens > 10 and 0 < u.completion_tokens <= 12
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_chat_streaming_with_usage(client: openai.OpenAI) -> None:
    messages = _chat(QUESTIONS[1])
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == full.usage.completion_tokens
    assert last.usage.prompt_tokens == full.usage.prompt_tokens
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks[:-1] if c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert len(chunks) >= 4  # streamed token by token, not in one piece


def test_streaming_without_usage_has_no_usage_chunk(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                            stream=True))
    assert all(c.usage is None and len(c.choices) == 1 for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completions_non_streaming_and_streaming(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert full.id.startswith("cmpl-") and full.object == "text_completion"
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 12
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks[:-1]) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_completions_prompt_forms_and_echo(server: RunningServer, client: openai.OpenAI) -> None:
    ids = [httpx.post(server.url + "/tokenize", json={"prompt": p}).json()["tokens"] for p in PROMPTS]
    by_text = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids[0], max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids[0])
    both = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert [c.index for c in both.choices] == [0, 1]
    assert both.choices[0].text == by_text.choices[0].text
    assert both.usage.prompt_tokens == len(ids[0]) + len(ids[1])
    assert both.usage.completion_tokens == 12
    echo = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, echo=True)
    assert echo.choices[0].text == PROMPTS[0] + by_text.choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                            echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == echo.choices[0].text


def _stop_across_tokens(client: openai.OpenAI) -> tuple[str, str, str]:
    """(prompt, greedy text, a stop string made of the end of one token and the start of the next)."""
    prompt = "Count from one to twenty in words, separated by commas: one, two, three,"
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, logprobs=0,
                                     extra_body={"ignore_eos": True})
    text, tokens = resp.choices[0].text, resp.choices[0].logprobs.tokens
    assert "".join(tokens) == text
    for i in range(2, len(tokens)):
        pos = sum(len(t) for t in tokens[:i])
        left, right = tokens[i - 1], tokens[i]
        for a, b in ((3, 1), (2, 2), (2, 1)):
            stop = left[-a:] + right[:b]
            if len(left) >= a and len(right) >= b and stop.strip() == stop and text.find(stop) == pos - a:
                return prompt, text, stop
    pytest.fail(f"no usable token boundary in {tokens}")


def test_stop_strings_never_emitted_even_across_chunks(client: openai.OpenAI) -> None:
    prompt, text, stop = _stop_across_tokens(client)
    expected = text[: text.find(stop)]
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stop=stop,
                                     extra_body={"ignore_eos": True})
    assert resp.choices[0].text == expected
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].model_extra["stop_reason"] == stop
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                            stop=[stop, "never-seen-xyz"], stream=True,
                                            extra_body={"ignore_eos": True}))
    pieces = [c.choices[0].text for c in chunks]
    assert "".join(pieces) == expected
    assert not any(stop in p for p in pieces)
    assert chunks[-1].choices[0].finish_reason == "stop"
    # vLLM extension: keep the stop string
    kept = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stop=stop,
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == expected + stop


def test_seed_reproducibility(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        r = client.chat.completions.create(model=MODEL, messages=_chat("Tell me a story."), max_tokens=16,
                                           temperature=1.0, seed=seed, extra_body={"ignore_eos": True})
        return r.choices[0].message.content

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(s) != first for s in (1, 2))


def test_n_choices(client: openai.OpenAI) -> None:
    kwargs = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 1.0, "seed": 7, "n": 3,
              "extra_body": {"ignore_eos": True}}
    resp = client.completions.create(**kwargs)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert resp.usage.completion_tokens == 24
    assert len({c.text for c in resp.choices}) > 1  # distinct seeds per choice
    again = client.completions.create(**kwargs)
    assert [c.text for c in again.choices] == [c.text for c in resp.choices]
    chunks = list(client.chat.completions.create(model=MODEL, messages=_chat("hi"), max_tokens=6, n=2,
                                                 temperature=0, stream=True))
    texts = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
    assert texts[0] == texts[1] and texts[0]


def test_chat_logprobs(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=_chat(QUESTIONS[0]), max_tokens=10,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the best token was chosen
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
    emitted = bytes(b for e in content for b in e.bytes).decode("utf-8", errors="replace")
    assert emitted.startswith(resp.choices[0].message.content)
    stream = client.chat.completions.create(model=MODEL, messages=_chat(QUESTIONS[0]), max_tokens=10,
                                            temperature=0, logprobs=True, stream=True)
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert all(e.top_logprobs == [] for e in streamed)


def test_completion_logprobs(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=2)
    lp = resp.choices[0].logprobs
    n = resp.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens) == resp.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    for tok, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0 and tok in top and len(top) == 2
        assert top[tok] == pytest.approx(max(top.values()))


def test_models_list_matches_responses(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == 2048
