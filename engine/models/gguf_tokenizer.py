"""A GGUF file's tokenizer metadata as Hugging Face tokenizer files (gpt2 BPE, or sentencepiece-style BPE)."""

from __future__ import annotations

import json
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from engine.models.gguf_file import py_value

# tokenizer.ggml.pre -> pre-tokenizer family (llama.cpp's llama-vocab.cpp groups them the same way).
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_LLAMA3_PRE = {"llama-bpe", "llama3", "smaug-bpe", "falcon3", "dbrx"}
_QWEN2_PRE = {"qwen2", "deepseek-r1-qwen", "stablelm2", "megrez", "hunyuan"}
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = _LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")

# tokenizer.ggml.token_type values.
_TT_NORMAL, _TT_UNKNOWN, _TT_CONTROL, _TT_USER_DEFINED = 1, 2, 3, 4


def _added_tokens(tokens: list[str], types: list[int]) -> list[dict[str, Any]]:
    # llama.cpp marks HF "special" added tokens CONTROL and non-special added tokens USER_DEFINED.
    return [
        {"id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": types[i] != _TT_USER_DEFINED}
        for i in range(len(tokens)) if types[i] in (_TT_UNKNOWN, _TT_CONTROL, _TT_USER_DEFINED)
    ]


def _gpt2_parts(md: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
    tokens: list[str] = md["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in md.get("tokenizer.ggml.merges", [])]
    model = models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False, byte_fallback=False)
    pre = py_value(md.get("tokenizer.ggml.pre", "default"))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    normalizer = None
    pre_tok: pre_tokenizers.PreTokenizer
    if pre in _DIGIT_SPLIT_PRE:
        pre_tok = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in _LLAMA3_PRE or pre in _QWEN2_PRE:
        regex = _LLAMA3_REGEX if pre in _LLAMA3_PRE else _QWEN2_REGEX
        pre_tok = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        normalizer = normalizers.NFC() if pre in _QWEN2_PRE else None
    else:
        # "default" / "gpt-2" and anything unknown: GPT-2's own regex.
        pre_tok = byte_level
    return model, normalizer, pre_tok, decoders.ByteLevel()


def _spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Derive BPE merges from sentencepiece scores, as HF's SentencePieceExtractor does."""
    vocab = {t: i for i, t in enumerate(tokens) if types[i] == _TT_NORMAL}
    merges: list[tuple[float, int, int, str, str]] = []
    for piece, pid in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((-scores[pid], vocab[left], vocab[right], left, right))
    merges.sort()  # highest score merges first; ties by the parts' ids
    return [(left, right) for *_, left, right in merges]


def _spm_parts(md: dict[str, Any], types: list[int]) -> tuple[Any, Any, Any, Any]:
    tokens: list[str] = md["tokenizer.ggml.tokens"]
    scores = py_value(md.get("tokenizer.ggml.scores")) or [-float(i) for i in range(len(tokens))]
    if "tokenizer.ggml.merges" in md:
        merges = [tuple(m.split(" ", 1)) for m in md["tokenizer.ggml.merges"]]
    else:
        merges = _spm_merges(tokens, scores, types)
    unk = next((tokens[i] for i, t in enumerate(types) if t == _TT_UNKNOWN), None)
    model = models.BPE({t: i for i, t in enumerate(tokens)}, merges, unk_token=unk,
                       fuse_unk=True, byte_fallback=True)
    # llama.cpp prefixes a space to every fragment after a special token: a per-segment normalizer.
    add_space = bool(py_value(md.get("tokenizer.ggml.add_space_prefix", True)))
    norms = [normalizers.Prepend("▁")] if add_space else []
    normalizer = normalizers.Sequence([*norms, normalizers.Replace(" ", "▁")])
    decs = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space:
        decs.append(decoders.Strip(" ", 1, 0))
    return model, normalizer, None, decoders.Sequence(decs)


def _tokenizer_parts(md: dict[str, Any], kind: Any, types: list[int]) -> tuple[Any, Any, Any, Any]:
    """(model, normalizer, pre-tokenizer, decoder) for the GGUF's tokenizer model."""
    if kind == "gpt2":
        return _gpt2_parts(md)
    if kind in ("llama", "gemma4"):  # gemma4: with its merges, no prefix space
        return _spm_parts(md, types)
    raise NotImplementedError(f"GGUF tokenizer model {kind!r} is not supported (only gpt2, llama and gemma4)")


def _post_processor(kind: Any, tokens: list[str], head: list[str], tail: list[str]) -> Any:
    """BOS / EOS around every sequence where the GGUF asks (None: nothing added)."""
    if head or tail:
        def template(seq: str, type_id: int) -> list[str]:
            return [f"{t}:{type_id}" for t in head] + [f"${seq}:{type_id}"] + [f"{t}:{type_id}" for t in tail]

        return processors.TemplateProcessing(
            single=template("A", 0), pair=template("A", 0) + template("B", 1),
            special_tokens=[(t, tokens.index(t)) for t in {*head, *tail}])
    if kind == "gpt2":
        return processors.ByteLevel(trim_offsets=False)
    return None


def build_tokenizer(md: dict[str, Any], context_length: int) -> tuple[dict, dict, dict]:
    """(tokenizer.json, tokenizer_config.json, special_tokens_map.json) contents."""
    kind = py_value(md.get("tokenizer.ggml.model"))
    tokens: list[str] = md["tokenizer.ggml.tokens"]
    types = py_value(md.get("tokenizer.ggml.token_type")) or [_TT_NORMAL] * len(tokens)
    model, normalizer, pre_tok, decoder = _tokenizer_parts(md, kind, types)

    def special(key: str) -> str | None:
        idx = py_value(md.get(f"tokenizer.ggml.{key}_token_id"))
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    bos, eos, pad, unk = special("bos"), special("eos"), special("padding"), special("unknown")
    add_bos = bool(py_value(md.get("tokenizer.ggml.add_bos_token", kind == "llama")))
    add_eos = bool(py_value(md.get("tokenizer.ggml.add_eos_token", False)))

    tok = Tokenizer(model)
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tok
    tok.decoder = decoder
    added = _added_tokens(tokens, types)
    tok.add_tokens([AddedToken(a["content"], special=a["special"], normalized=False) for a in added])
    post = _post_processor(kind, tokens, [bos] if add_bos and bos else [], [eos] if add_eos and eos else [])
    if post is not None:
        tok.post_processor = post
    tokenizer_json = json.loads(tok.to_str())
    # add_tokens() re-adds tokens already in the vocab under their ids; assert nothing shifted.
    got = {a["content"]: a["id"] for a in tokenizer_json["added_tokens"]}
    if any(got.get(a["content"]) != a["id"] for a in added):
        raise ValueError("added tokens did not keep their GGUF ids")

    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "unk_token": unk,
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
    }
    if template := py_value(md.get("tokenizer.chat_template")):
        tokenizer_config["chat_template"] = template
    special_map = {k: v for k, v in (("bos_token", bos), ("eos_token", eos), ("pad_token", pad),
                                     ("unk_token", unk)) if v is not None}
    return tokenizer_json, tokenizer_config, special_map


def stop_ids(md: dict[str, Any]) -> list[int]:
    # Chat models often end turns with EOT (e.g. <|eot_id|>) rather than EOS; stop on both.
    ids = [py_value(md.get(f"tokenizer.ggml.{k}_token_id")) for k in ("eos", "eot", "eom")]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))
