"""`/tokenize` (a prompt, or messages through the chat template) and `/detokenize`."""

from __future__ import annotations

from server.errors import bad_request
from server.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from server.serving import OpenAIServing


class TokenizationServing:
    """Both endpoints over the shared `OpenAIServing` (no engine work: the tokenizer only)."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        s = self.serving
        s.resolve_model(req.model)
        req.check()
        if req.prompt is not None:
            prompt = req.prompt
            s.tokens.check_length(prompt, "prompt")
            add_special = True if req.add_special_tokens is None else req.add_special_tokens

            def encode() -> list[int]:
                return s.tokens.encode(prompt, add_special)
        else:
            messages = req.messages
            assert messages is not None
            s.chat_prompts.check_messages(messages)
            source, kwargs = s.chat_prompts.template_request(req.chat_template, req.chat_template_kwargs)

            def encode() -> list[int]:
                return s.chat_prompts.render(messages, source, kwargs, req.add_generation_prompt,
                                             req.continue_final_message)

        def preprocess() -> tuple[list[int], list[str] | None]:
            ids = encode()
            strs = list(s.client.tokenizer.convert_ids_to_tokens(ids)) if req.return_token_strs else None
            return ids, strs

        ids, strs = await s.offload(preprocess)
        return TokenizeResponse(count=len(ids), max_model_len=s.client.max_model_len, tokens=ids,
                                token_strs=strs)

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        s = self.serving
        s.resolve_model(req.model)
        max_len, vocab = s.client.max_model_len, s.client.core.loaded.vocab_size
        if len(req.tokens) > max_len:
            raise bad_request(f"{len(req.tokens)} tokens are more than max_model_len={max_len}",
                              param="tokens")
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is out of vocabulary (size {vocab})", param="tokens")
        return DetokenizeResponse(prompt=await s.offload(s.tokens.decode, req.tokens, False))
