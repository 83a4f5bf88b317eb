"""Tool-call parsers: how a model's reply names the tools it calls, one registered format each
(``environment.tool_call_format``; ``TOOL_CALL_FORMATS`` in llm/settings/registry.py).

A parser reads the decoded text of one model turn (special tokens kept, the final EOS removed) and returns a
``ParsedReply``: the text around the calls, the calls it read, and one error per call it saw but could not read
(bad JSON, no name): those go back to the model as error messages. A reply with no call in the format is plain
content. The formats, with the published examples the tests read:

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call (Hermes 2 Pro, Qwen2.5,
  Qwen3; their chat templates describe the tools in the same words).
- ``qwen3_xml``: ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>`` (Qwen3.5,
  Qwen3-Coder, Nemotron 3); a value is JSON where it reads as JSON, else the text.
- ``llama3``: the whole reply one JSON object ``{"name": ..., "parameters": {...}}`` (Llama 3.1 / 3.2's JSON tool
  calling; ``arguments`` read too), after an optional ``<|python_tag|>``; several separated by ``;``.
- ``mistral``: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` (tokenizer v3) or
  ``[TOOL_CALLS]NAME[ARGS]{...}`` (v11 and later, with an optional ``[CALL_ID]id``).
- ``glm4``: ``<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>`` (GLM-4.5).
- ``pythonic``: ``[f(x=1, y="a"), g()]`` with literal arguments (Llama 3.2's pythonic calls, LFM2.5 inside
  ``<|tool_call_start|>...<|tool_call_end|>``).

A new format: a function ``text -> ParsedReply`` decorated ``@register_format("name")`` here; the chat-template
detection (``detect_format``) tries every registered format, so a template that renders calls in the new format is
recognised without more code. Tests: tests/test_agent_parsers.py (published examples and real templates).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llm.settings.registry import TOOL_CALL_FORMATS


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass
class ParsedReply:
    content: str  # the reply without its tool calls
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # calls seen but not readable, each told to the model

    @property
    def has_calls(self) -> bool:
        return bool(self.calls or self.errors)


Parser = Callable[[str], ParsedReply]


def register_format(name: str) -> Callable[[Parser], Parser]:
    def register(fn: Parser) -> Parser:
        TOOL_CALL_FORMATS.add(name, fn)
        return fn

    return register


def call_from_json(data: Any, keys: tuple[str, ...] = ("arguments",)) -> ToolCall:
    """``{"name": str, "arguments": {...}}`` (or another of ``keys`` for the arguments; arguments given as a JSON
    string are read too) -> a call; anything else raises ValueError saying what is wrong."""
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        raise ValueError('a tool call must be a JSON object {"name": "<tool>", "arguments": {...}}')
    args = next((data[k] for k in keys if k in data), {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as err:
            raise ValueError(f"the arguments of {data['name']!r} are not JSON ({err.msg})") from None
    if not isinstance(args, dict):
        kind = type(args).__name__
        raise ValueError(f"the arguments of {data['name']!r} must be a JSON object, got {kind}")  # noqa: TRY004
    return ToolCall(data["name"], args)


def _json_call(text: str, keys: tuple[str, ...] = ("arguments",)) -> ToolCall:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"the tool call is not valid JSON ({err.msg} at character {err.pos}): {text[:200]!r}"
        ) from None
    return call_from_json(data, keys)


_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


@register_format("hermes")
def parse_hermes(text: str) -> ParsedReply:
    out = ParsedReply(_HERMES.sub("", text).strip())
    for body, close in _HERMES.findall(text):
        if not close:
            out.errors.append("the tool call has no closing </tool_call>")
            continue
        try:
            out.calls.append(_json_call(body.strip()))
        except ValueError as err:
            out.errors.append(str(err))
    return out


_XML_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def _xml_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


@register_format("qwen3_xml")
def parse_qwen3_xml(text: str) -> ParsedReply:
    out = ParsedReply(_HERMES.sub("", text).strip())
    for body, close in _HERMES.findall(text):
        function = _XML_FUNCTION.search(body)
        if not close or function is None:
            out.errors.append(
                "a tool call must read <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n"
                "</function>\n</tool_call>"
            )
            continue
        args = {key.strip(): _xml_value(value) for key, value in _XML_PARAMETER.findall(function.group(2))}
        out.calls.append(ToolCall(function.group(1).strip(), args))
    return out


@register_format("llama3")
def parse_llama3(text: str) -> ParsedReply:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return ParsedReply(text.strip())
    out, decoder, at = ParsedReply(""), json.JSONDecoder(), 0
    while at < len(body) and body[at] == "{":
        try:
            data, at = decoder.raw_decode(body, at)
            out.calls.append(call_from_json(data, ("parameters", "arguments")))
        except json.JSONDecodeError as err:
            out.errors.append(f"the tool call is not valid JSON ({err.msg} at character {err.pos}): {body[:200]!r}")
            return out
        except ValueError as err:
            out.errors.append(str(err))
        while at < len(body) and body[at] in "; \n\t":
            at += 1
    out.content = body[at:].strip()
    return out


_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


@register_format("glm4")
def parse_glm4(text: str) -> ParsedReply:
    out = ParsedReply(_HERMES.sub("", text).strip())
    for body, close in _HERMES.findall(text):
        name = body.strip().split("\n", 1)[0].split("<arg_key>", 1)[0].strip()
        if not close or not name or name.startswith(("{", "<")):
            out.errors.append(
                "a tool call must read <tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>\n"
                "</tool_call>"
            )
            continue
        out.calls.append(ToolCall(name, {k.strip(): _xml_value(v) for k, v in _GLM_ARG.findall(body)}))
    return out


_MISTRAL_V11 = re.compile(r"\s*([^\s\[]+)(?:\[CALL_ID\][^\[]*)?\[ARGS\]")


@register_format("mistral")
def parse_mistral(text: str) -> ParsedReply:
    content, marker, rest = text.partition("[TOOL_CALLS]")
    out = ParsedReply(content.strip())
    if not marker:
        return out
    for part in rest.split("[TOOL_CALLS]"):
        named = _MISTRAL_V11.match(part)
        try:
            if named:  # NAME[ARGS]{json}
                args, _ = json.JSONDecoder().raw_decode(part[named.end() :].lstrip())
                out.calls.append(call_from_json({"name": named.group(1), "arguments": args}))
                continue
            calls, _ = json.JSONDecoder().raw_decode(part.lstrip())  # [{"name", "arguments"}, ...]
            for data in calls if isinstance(calls, list) else [calls]:
                out.calls.append(call_from_json(data))
        except json.JSONDecodeError as err:
            out.errors.append(f"the tool call is not valid JSON ({err.msg}): {part[:200]!r}")
        except ValueError as err:
            out.errors.append(str(err))
    return out


_PYTHONIC_BLOCK = re.compile(r"<\|tool_call_start\|>(.*?)(<\|tool_call_end\|>|$)", re.DOTALL)
_LOOKS_PYTHONIC = re.compile(r"\[\s*[A-Za-z_][\w.]*\(")


def _pythonic_calls(source: str) -> list[ToolCall]:
    tree = ast.parse(source.strip(), mode="eval").body
    if not isinstance(tree, ast.List) or not all(isinstance(c, ast.Call) for c in tree.elts):
        raise ValueError("tool calls must be a list of calls, [name(key=value, ...), ...]")
    calls = []
    for c in tree.elts:
        if not isinstance(c.func, ast.Name) or c.args:
            raise ValueError(f"{ast.unparse(c)}: a call names a tool and passes keyword arguments only")
        try:
            calls.append(ToolCall(c.func.id, {k.arg: ast.literal_eval(k.value) for k in c.keywords}))
        except ValueError:
            raise ValueError(f"{ast.unparse(c)}: arguments must be literals (numbers, strings, lists, ...)") from None
    return calls


@register_format("pythonic")
def parse_pythonic(text: str) -> ParsedReply:
    blocks = _PYTHONIC_BLOCK.findall(text)
    if blocks:
        out = ParsedReply(_PYTHONIC_BLOCK.sub("", text).strip())
        sources = [body for body, _ in blocks]
    else:
        body = text.strip()
        if not _LOOKS_PYTHONIC.match(body):
            return ParsedReply(body)
        end = body.rfind("]")
        while end > 0:  # the longest prefix that parses: trailing text (an end-of-turn marker) is content
            try:
                ast.parse(body[: end + 1], mode="eval")
                break
            except SyntaxError:
                end = body.rfind("]", 0, end)
        out = ParsedReply(body[end + 1 :].strip() if end > 0 else "")
        sources = [body[: end + 1] if end > 0 else body]
    for source in sources:
        try:
            out.calls.extend(_pythonic_calls(source))
        except (SyntaxError, ValueError) as err:
            out.errors.append(f"the tool calls do not parse ({err}): {source[:200]!r}")
    return out


def detect_format(rendered_call: str, expected: ToolCall) -> str | None:
    """The registered format that reads ``rendered_call`` (an assistant message with the one call ``expected``, as a
    chat template writes it) back as exactly that call; None when none does."""
    for name in TOOL_CALL_FORMATS:
        parsed = TOOL_CALL_FORMATS[name](rendered_call)
        if parsed.calls == [expected] and not parsed.errors:
            return name
    return None
