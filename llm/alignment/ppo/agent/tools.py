"""Tools: plain Python functions (``environment.tools: ["package.module:function", ...]``) with type hints and a
docstring, described to the model by the JSON schema transformers derives from them
(``transformers.utils.get_json_schema``, the schema ``apply_chat_template(..., tools=...)`` renders).

A call the model makes is checked (a known tool, arguments that bind to the signature and have the schema's JSON
types) and run, bounded by ``environment.step_timeout``: in this process (a daemon thread: a call that never
returns is abandoned there) or, with ``environment.sandbox``, in a child process (sandbox.py). Whatever goes wrong
(unknown tool, wrong arguments, an exception, a timeout, a result over ``max_observation_chars``) is a
``ToolResult`` with ``error`` set, whose text goes back to the model: a bad call never stops the run.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llm.alignment.ppo.agent.parsers import ToolCall
from llm.alignment.ppo.agent.sandbox import SandboxError
from llm.alignment.ppo.agent.specs import SpecError, import_object, result_text
from llm.alignment.ppo.agent.timeouts import StepTimeout, call_with_timeout
from llm.utils.errors import UserError


@dataclass(frozen=True)
class Tool:
    spec: str  # package.module:function
    fn: Callable[..., Any]
    schema: dict[str, Any]  # {"type": "function", "function": {"name", "description", "parameters"}}

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]


@dataclass(frozen=True)
class ToolResult:
    name: str
    text: str  # the tool message's content: the result, or the error the model is told
    error: bool = False
    seconds: float = 0.0


def load_tool(spec: str) -> Tool:
    from transformers.utils import get_json_schema

    try:
        fn = import_object(spec)
    except SpecError as err:
        raise UserError(f"environment.tools: {err}") from None
    if not inspect.isfunction(fn):
        raise UserError(f"environment.tools: {spec!r} is not a function (a def with type hints and a docstring)")
    try:
        schema = get_json_schema(fn)
    except Exception as err:  # noqa: BLE001 - transformers' DocstringParsingException / TypeHintParsingException
        raise UserError(
            f"environment.tools: {spec!r}: its description for the model cannot be made ({err}); give it type hints "
            "and a docstring with a line per argument under 'Args:' (Google style)"
        ) from None
    return Tool(spec, fn, schema)


def load_tools(specs: list[str]) -> dict[str, Tool]:
    tools: dict[str, Tool] = {}
    for spec in specs:
        tool = load_tool(spec)
        if tool.name in tools:
            raise UserError(
                f"environment.tools: {spec!r} and {tools[tool.name].spec!r} are both called {tool.name!r}: the model "
                "names a tool by its function name, so give them different names"
            )
        tools[tool.name] = tool
    return tools


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


def _fits(value: Any, kinds: list[str]) -> bool:
    for kind in kinds:
        types = _JSON_TYPES.get(kind)
        if types is None or (isinstance(value, types) and not (isinstance(value, bool) and bool not in types)):
            return True  # a kind this check does not know is left to the function
    return False


def argument_error(tool: Tool, arguments: dict[str, Any]) -> str | None:
    """Why ``arguments`` do not fit ``tool`` (the signature, and the schema's JSON type of each), or None."""
    try:
        inspect.signature(tool.fn).bind(**arguments)
    except TypeError as err:
        return f"wrong arguments for {tool.name}: {err}"
    properties = tool.schema["function"].get("parameters", {}).get("properties", {})
    for key, value in arguments.items():
        kinds = properties.get(key, {}).get("type")
        if kinds is None:
            continue
        kinds = kinds if isinstance(kinds, list) else [kinds]
        if not _fits(value, kinds):
            return f"wrong arguments for {tool.name}: {key} must be {' or '.join(kinds)}, got {value!r}"
    return None


class ToolBox:
    """The run's tools and how a call runs: ``run(call) -> ToolResult``; ``sandbox`` a ``SandboxPool`` or None
    (in this process)."""

    def __init__(self, tools: dict[str, Tool], timeout: float, max_chars: int, sandbox=None) -> None:
        self.tools, self.timeout, self.max_chars, self.sandbox = tools, timeout, max_chars, sandbox

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.tools.values()]

    def run(self, call: ToolCall) -> ToolResult:
        start = time.perf_counter()
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolResult(
                call.name, f"Error: unknown tool {call.name!r}; the tools are {', '.join(self.tools)}", True
            )
        wrong = argument_error(tool, call.arguments)
        if wrong is not None:
            return ToolResult(call.name, f"Error: {wrong}", True)
        try:
            if self.sandbox is not None:
                text = self.sandbox.call(tool.spec, call.arguments, self.timeout)
            else:
                text = result_text(call_with_timeout(lambda: tool.fn(**call.arguments), self.timeout, call.name))
        except StepTimeout as err:
            return ToolResult(call.name, f"Error: {call.name} timed out ({err})", True, time.perf_counter() - start)
        except SandboxError as err:  # the child's exception ("ValueError: ...") or its death
            return ToolResult(call.name, f"Error: {call.name} failed: {err}", True, time.perf_counter() - start)
        except BaseException as err:  # noqa: BLE001 - the tool's failure (sys.exit too) is the model's to see, never the run's
            return ToolResult(
                call.name, f"Error: {call.name} raised {type(err).__name__}: {err}", True, time.perf_counter() - start
            )
        seconds = time.perf_counter() - start
        if len(text) > self.max_chars:
            return ToolResult(
                call.name,
                f"Error: {call.name} returned {len(text)} characters, more than environment.max_observation_chars="
                f"{self.max_chars}",
                True,
                seconds,
            )
        return ToolResult(call.name, text, False, seconds)
