"""Chat messages -> prompt tokens, for /v1/chat/completions and /tokenize: the server's chat template and
default kwargs, the checks on a request's own template fields, and the bounded render."""

from __future__ import annotations

import logging
from typing import Any

import jinja2

from server.chat_template import ChatTemplate, RenderLimitError, compile_template, forbidden_kwarg
from server.errors import bad_request
from server.protocol import ChatMessage
from server.settings import ServerSettings
from server.tokens import TokenText
from specserve_configs import shipped

logger = logging.getLogger(__name__)

_CONTINUE_MARK = "\U000f0000"  # a private-use character no template alters (no case, not whitespace)


def _model_template(tokenizer: Any) -> str | None:
    try:
        return tokenizer.get_chat_template()
    except (ValueError, AttributeError):  # the model has none
        return None


class ChatPrompts:
    """Raises ValueError for settings that do not fit the model (the chat template or its defaults)."""

    def __init__(self, settings: ServerSettings, tokens: TokenText, max_model_len: int,
                 default_model: bool) -> None:
        self.settings = settings
        self.tokens = tokens
        self.max_model_len = max_model_len
        source = settings.chat_template or _model_template(tokens.tokenizer)
        if settings.chat_template is None and default_model:
            # The default model's own template plus tools (identical without them): tool calling works
            # out of the box.
            source = shipped("templates", "smollm2-tools.jinja").read_text()
        try:
            self.chat_template = compile_template(source) if source is not None else None
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"the chat template is not valid Jinja: {e}") from e
        self.default_kwargs = self._check_default_kwargs(settings.default_chat_template_kwargs or {})

    def _check_default_kwargs(self, defaults: dict[str, Any]) -> dict[str, Any]:
        bad = forbidden_kwarg(defaults, self.tokens.special_tokens)
        if bad is not None:
            raise ValueError(f"--default-chat-template-kwargs: `{bad}` is a tokenizer option or a name the "
                             f"server fills in, not a chat template variable")
        unread = sorted(set(defaults) - (self.chat_template.variables if self.chat_template else frozenset()))
        if unread:
            logger.warning("--default-chat-template-kwargs: the chat template does not read %s; ignored "
                           "unless a request's own template does", ", ".join(unread))
        return defaults

    def check_messages(self, messages: list[ChatMessage]) -> None:
        """Cheap bounds before rendering: more messages than context tokens, or more text than any prompt
        that fits the context, cannot make a prompt."""
        max_len, max_chars = self.max_model_len, self.tokens.max_chars
        if len(messages) > max_len:
            raise bad_request(f"{len(messages)} messages are more than max_model_len={max_len} tokens can "
                              f"hold", param="messages")
        chars = sum(m.num_chars() for m in messages)
        if chars > max_chars:
            raise bad_request(f"the messages have {chars} characters; the limit is {max_chars} "
                              f"(--max-prompt-chars)", param="messages", code="prompt_too_long")

    def template_request(self, source: str | None, kwargs: dict[str, Any] | None) -> tuple[str | None,
                                                                                           dict[str, Any]]:
        """Cheap checks of a request's template fields: whether it may bring a template (the `chat_template`
        field, or a kwarg of that name), and no kwarg naming a tokenizer option or a server-filled variable.
        Returns the request's template (None: the server's) and its kwargs."""
        kwargs = dict(kwargs or {})
        param = "chat_template"
        in_kwargs = kwargs.pop("chat_template", None)
        if in_kwargs is not None:
            if source is not None and in_kwargs != source:
                raise bad_request("`chat_template` and `chat_template_kwargs.chat_template` differ; send one",
                                  param="chat_template")
            if not isinstance(in_kwargs, str):
                raise bad_request("`chat_template_kwargs.chat_template` must be a string",
                                  param="chat_template_kwargs.chat_template")
            source, param = in_kwargs, "chat_template_kwargs.chat_template"
        if source is not None and not self.settings.trust_request_chat_template:
            raise bad_request("this server does not render chat templates sent with requests (start it with "
                              "--trust-request-chat-template to allow them)", param=param)
        bad = forbidden_kwarg(kwargs, self.tokens.special_tokens)
        if bad is not None:
            raise bad_request(f"`chat_template_kwargs.{bad}` is not allowed: chat_template_kwargs may set "
                              f"the chat template's own variables only, not tokenizer options or the names "
                              f"the server fills in", param=f"chat_template_kwargs.{bad}")
        if source is None and self.chat_template is None:
            raise bad_request("this model has no chat template; pass --chat-template or use /v1/completions")
        return source, kwargs

    def render(self, messages: list[ChatMessage], source: str | None, kwargs: dict[str, Any],
               add_generation_prompt: bool, continue_final_message: bool,
               tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The chat's prompt tokens (blocking: call through `offload`). Variables the template does not
        read are dropped, as vLLM drops them: clients send e.g. `enable_thinking` to every model."""
        template: ChatTemplate | None = self.chat_template
        if source is not None:
            try:
                template = compile_template(source)
            except jinja2.TemplateSyntaxError as e:
                raise bad_request(f"the chat template is not valid Jinja: {e}",
                                  param="chat_template") from None
        assert template is not None  # template_request refused the request otherwise
        if tools and "tools" not in template.variables:
            raise bad_request("this model's chat template does not render `tools`: start the server with a "
                              "--chat-template that does, or send tool_choice none", param="tools")
        merged = {**self.default_kwargs, **kwargs}
        variables = {k: v for k, v in merged.items() if k in template.variables}
        return self._tokens(messages, template, variables, add_generation_prompt, continue_final_message,
                            tools)

    def _tokens(self, messages: list[ChatMessage], template: ChatTemplate, variables: dict[str, Any],
                add_generation_prompt: bool, continue_final_message: bool,
                tools: list[dict[str, Any]] | None) -> list[int]:
        """Render (bounded by --chat-template-timeout and the prompt size limit) and tokenize; the template
        adds any special tokens."""
        conversation = [m.template_fields(i) for i, m in enumerate(messages)]
        if continue_final_message:
            if conversation[-1]["role"] != "assistant":
                raise bad_request("`continue_final_message` needs the last message to be the assistant's",
                                  param="continue_final_message")
            conversation[-1]["content"] += _CONTINUE_MARK
        context = {**self.tokens.special_tokens, **variables, "messages": conversation,
                   "tools": tools or None, "documents": None, "add_generation_prompt": add_generation_prompt}
        try:
            text = template.render(context, self.settings.chat_template_timeout, self.tokens.max_chars)
        except RenderLimitError as e:
            raise bad_request(str(e), param="messages", code="chat_template_limit") from None
        except Exception as e:  # noqa: BLE001 - template errors (e.g. role order) are the caller's
            raise bad_request(f"the chat template failed on these messages: {e}", param="messages") from e
        if continue_final_message:
            # Cut where the last message ends, so the model goes on writing it.
            end = text.rfind(_CONTINUE_MARK)
            if end < 0:
                raise bad_request("`continue_final_message`: the chat template does not keep the end of the "
                                  "last message", param="continue_final_message")
            text = text[:end]
        return self.tokens.encode(text, add_special_tokens=False, param="messages")
