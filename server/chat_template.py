"""Chat templates: Jinja in `ImmutableSandboxedEnvironment`, each render bounded in time and size (calls,
loop iterations and `{{ }}` output check the clock; string-building operators and joins check sizes before
they allocate), and which variables a request may set: those the template reads, never the names the
server fills in nor tokenizer options."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any, cast

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2 import nodes
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

# Filled in by the server on every render.
SERVER_VARIABLES = frozenset({
    "messages", "tools", "documents", "add_generation_prompt",
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
    "additional_special_tokens",
})
# Arguments of transformers' apply_chat_template and of the tokenizer call behind it: options of the
# tokenizer, not of the template, so never a request's to set (`return_*` too).
TOKENIZER_OPTIONS = frozenset({
    "chat_template", "tokenize", "padding", "truncation", "max_length", "stride", "pad_to_multiple_of",
    "padding_side", "tokenizer_kwargs", "add_special_tokens", "continue_final_message", "conversation",
    "sanitize_control_tokens", "is_split_into_words", "verbose", "split_special_tokens",
})
_MAX_INT_BITS = 1 << 16  # integer arithmetic in a template never needs more; 2 ** 10 ** 9 would take minutes
_LOOP_GUARD = "__specserve_bounded_loop__"
_JOIN_GUARD = "__specserve_bounded_join__"


class RenderLimitError(Exception):
    """A render ran past its time or size limit (the message says which, and the flag that sets it)."""


_YIELD_S = 0.001


@dataclass(slots=True)
class _Budget:
    deadline: float
    timeout: float
    max_chars: int
    last_yield: float = 0.0

    def tick(self) -> None:
        now = time.monotonic()
        if now > self.deadline:
            raise RenderLimitError(f"the chat template took longer than {self.timeout:g} s to render "
                                   f"(--chat-template-timeout)")
        if now - self.last_yield > _YIELD_S:
            # Hand the GIL over now and then: otherwise the event loop and the engine thread wait up to
            # the interpreter's switch interval each time they need it back, many times per request.
            self.last_yield = now
            time.sleep(0)

    def size(self, n: int) -> None:
        if n > self.max_chars:
            raise RenderLimitError(f"the chat template built a text of over {self.max_chars} characters, "
                                   f"more than a prompt can hold (--max-prompt-chars)")


# Per render; each render runs on one thread from start to end.
_budget: ContextVar[_Budget | None] = ContextVar("chat_template_budget", default=None)


def _tick() -> None:
    budget = _budget.get()
    if budget is not None:
        budget.tick()


def _bounded_loop(iterable: Iterable[Any]) -> Iterator[Any]:
    """Wraps the iterable of every `{% for %}`: nested loops are where a template spends unbounded time."""
    budget = _budget.get()
    for item in iterable:
        if budget is not None:
            budget.tick()
        yield item


def _bounded_join(*parts: Any) -> str:
    """Replaces the `~` operator, so a loop that doubles a string stops at the size limit."""
    texts = [str(p) for p in parts]
    budget = _budget.get()
    if budget is not None:
        budget.size(sum(len(t) for t in texts))
    return "".join(texts)


class _Bounded(NodeTransformer):
    """Rewrites a parsed template: every `{% for %}` iterates through `_bounded_loop`, every `~` joins
    through `_bounded_join` (both are calls to globals, which the sandbox routes through `call`)."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        # jinja2 annotates For.iter as any Node; its parser always gives an expression.
        node.iter = _call(_LOOP_GUARD, [cast(nodes.Expr, node.iter)], node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return _call(_JOIN_GUARD, node.nodes, node.lineno)


def _call(name: str, args: list[nodes.Expr], lineno: int) -> nodes.Call:
    return nodes.Call(nodes.Name(name, "load"), args, [], None, None, lineno=lineno)


def _bounded_concat(pieces: Iterable[str]) -> str:
    """The environment's join of output pieces (the whole render, and every macro and block)."""
    budget = _budget.get()
    if budget is None:
        return "".join(pieces)
    out, total = [], 0
    for piece in pieces:
        budget.tick()
        total += len(piece)
        budget.size(total)
        out.append(piece)
    return "".join(out)


def _finalize(value: Any) -> Any:
    """Applied to every `{{ expression }}` before it is output."""
    budget = _budget.get()
    if budget is not None:
        budget.tick()
        if isinstance(value, str):
            budget.size(len(value))
    return value


def _check_binop(operator: str, left: Any, right: Any) -> None:
    budget = _budget.get()
    if budget is None:
        return
    budget.tick()
    sized = (str, list, tuple)
    if operator == "+" and isinstance(left, sized) and isinstance(right, sized):
        budget.size(len(left) + len(right))
    elif operator == "*":
        if isinstance(left, sized) and isinstance(right, int):
            budget.size(len(left) * max(right, 0))
        elif isinstance(right, sized) and isinstance(left, int):
            budget.size(len(right) * max(left, 0))
        elif isinstance(left, int) and isinstance(right, int) and (
                left.bit_length() + right.bit_length() > _MAX_INT_BITS):
            raise RenderLimitError("the chat template multiplies integers that are too large")
    elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and (
            right * left.bit_length() > _MAX_INT_BITS):
        raise RenderLimitError("the chat template raises an integer to a power that is too large")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (HF's marker of assistant text for training masks) renders
    its body; serving has no use for the mask."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"+", "*", "**"})

    def __init__(self) -> None:
        # trim/lstrip blocks and loopcontrols: what transformers renders templates with, so output matches
        super().__init__(trim_blocks=True, lstrip_blocks=True, finalize=_finalize,
                         extensions=[jinja2.ext.loopcontrols, _GenerationTag])
        self.concat = _bounded_concat  # type: ignore[method-assign]  # jinja2 reads it per instance
        del self.globals["lipsum"]  # lipsum(n) writes n paragraphs: nothing a chat template needs
        self.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                            dict=_TemplateDict(), **{_LOOP_GUARD: _bounded_loop, _JOIN_GUARD: _bounded_join})
        self.filters["tojson"] = _tojson

    def call(self, context: Context, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        _tick()
        return super().call(context, obj, *args, **kwargs)

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        _check_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class _TemplateDict:
    """`dict(...)` for templates, without handing them the `dict` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args)


_ENV = _BoundedEnvironment()


class ChatTemplate:
    """One compiled template and the variables it reads."""

    def __init__(self, source: str) -> None:
        ast = _ENV.parse(source)
        self.variables = frozenset(jinja2.meta.find_undeclared_variables(ast)) - _ENV.globals.keys()
        ast = _Bounded().visit(ast)
        ast.set_environment(_ENV)
        self._template = _ENV.from_string(ast)

    def render(self, variables: Mapping[str, Any], timeout: float, max_chars: int) -> str:
        """Raises RenderLimitError past `timeout` seconds or `max_chars` characters; jinja2.TemplateError
        (or whatever the template's operations raise) when the template fails."""
        token = _budget.set(_Budget(time.monotonic() + timeout, timeout, max_chars))
        try:
            return self._template.render(variables)
        finally:
            _budget.reset(token)


@lru_cache(maxsize=16)
def compile_template(source: str) -> ChatTemplate:
    """Compiled once per template text (jinja2.TemplateSyntaxError if it is not valid Jinja)."""
    return ChatTemplate(source)


def forbidden_kwarg(kwargs: Mapping[str, Any], special_tokens: Iterable[str] = ()) -> str | None:
    """The first key no request may set, whatever the template reads: names the server fills in (the
    tokenizer's special tokens among them) and tokenizer options."""
    reserved = SERVER_VARIABLES | TOKENIZER_OPTIONS | frozenset(special_tokens)
    return next((k for k in kwargs if k in reserved or k.startswith("return_")), None)
