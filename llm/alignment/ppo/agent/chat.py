"""The chat template of an episode: the prompt with the tools, and the tokens each new message adds.

Token-exact turns: the model's own tokens are never decoded and encoded again. After a model turn (which ends with
the tokenizer's EOS) the loop appends only the tokens the template adds for the new messages (the environment's
user message, or the tool results) and the next generation prompt, found on a stand-in conversation:

    prefix   = render([user, assistant(+calls)])                 ...<|im_start|>assistant\\nx<|im_end|>\\n
    extended = render([user, assistant(+calls), *new], gen=True) ...<|im_start|>assistant\\nx<|im_end|>\\n<|im_start|>user\\n...
    new ids  = extended's ids after the prefix's last EOS         \\n<|im_start|>user\\nOBS<|im_end|>\\n<|im_start|>assistant\\n

(the template's glue after EOS, here the newline, belongs to the new ids: TRL's GRPO tool loop does the same; a turn
that ended at another of the run's stop ids, say Qwen2.5's <|endoftext|>, keeps it, and the same new ids follow). The
template must render a conversation's beginning the same whatever follows (prefix-preserving), and end an assistant
message with the tokenizer's EOS; both are checked when the run starts.

Tools reach the model through the template (``apply_chat_template(..., tools=schemas)``) and its tool-call format
is the registered parser that reads back a call the template rendered (parsers.detect_format). A template that
renders no tools (SmolLM2's plain ChatML) gets them described in a system message in the Hermes format (Qwen2.5's
words), and the results come back in ``<tool_response>`` blocks: as tool messages, or as a user message where the
template renders no tool role.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from llm.alignment.ppo.agent.parsers import ParsedReply, ToolCall, detect_format
from llm.alignment.ppo.agent.tools import ToolResult
from llm.settings.environment import AUTO_FORMAT
from llm.settings.registry import TOOL_CALL_FORMATS
from llm.utils.errors import UserError

logger = logging.getLogger(__name__)

_PROBE = ToolCall("probe_tool_7f3a", {"probe_arg_91c2": "probe_value_55e1"})
_PROBE_SCHEMA = {
    "type": "function",
    "function": {
        "name": _PROBE.name,
        "description": "A probe.",
        "parameters": {
            "type": "object",
            "properties": {"probe_arg_91c2": {"type": "string", "description": "A value."}},
            "required": ["probe_arg_91c2"],
        },
    },
}
_PROBE_RESULT = "probe_result_c4f9"

HERMES_TOOLS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function "
    "signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each function call, return a "
    "json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def hermes_tools_text(schemas: list[dict[str, Any]]) -> str:
    return HERMES_TOOLS.format(tools="\n".join(json.dumps(s, ensure_ascii=False) for s in schemas))


def call_message(calls: list[ToolCall]) -> dict[str, Any]:
    """An assistant message with ``calls``, as chat templates take it."""
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls],
    }


class TemplateFailure(UserError):
    """The chat template raised on a conversation an episode needs."""


class ChatFormat:
    """The actor tokenizer's chat template for episodes with ``schemas`` (the tools' JSON schemas, maybe none) and
    the configured ``tool_call_format``. ``prompt_ids(messages)``: the first prompt; ``message_ids(new, tool)``:
    the tokens after a model turn; ``parse(text)``: the tool calls of a reply."""

    def __init__(self, tokenizer, schemas: list[dict[str, Any]], tool_call_format: str = AUTO_FORMAT) -> None:
        name = getattr(tokenizer, "name_or_path", "") or "the actor tokenizer"
        if getattr(tokenizer, "chat_template", None) is None:
            raise UserError(
                f"environment: {name} has no chat template, and an episode's messages are rendered with it: use an "
                "instruct model's tokenizer (actor_rollout.tokenizer_name_or_path)"
            )
        if tokenizer.eos_token_id is None:
            raise UserError(f"environment: {name} has no EOS token, which ends a model turn")
        self.tokenizer, self.schemas, self.where = tokenizer, schemas, name
        self.renders_tools = bool(schemas) and self._renders_tools()
        self.tool_role = self._renders_tool_role()
        self.system_tools = hermes_tools_text(schemas) if schemas and not self.renders_tools else None
        self.format = self._choose_format(tool_call_format) if schemas else None
        self.parse_fn = TOOL_CALL_FORMATS[self.format] if self.format else None
        self._prefixes: dict[str | None, tuple[list[int], int]] = {}
        self.message_ids([{"role": "user", "content": "probe"}])  # the template's two properties, checked now
        if schemas:
            self.message_ids(self.tool_messages([ToolResult(_PROBE.name, _PROBE_RESULT)]), _PROBE.name)

    # --- rendering --------------------------------------------------------------------------------------
    def render(self, messages: list[dict[str, Any]], generation_prompt: bool, tools: list | None = None) -> str:
        tools = tools if tools is not None else (self.schemas if self.renders_tools else None)
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools or None, add_generation_prompt=generation_prompt, tokenize=False
            )
        except Exception as err:  # noqa: BLE001 - the template's own error (jinja), said with the roles it met
            roles = ", ".join(m["role"] for m in messages)
            raise TemplateFailure(f"the chat template of {self.where} cannot render [{roles}]: {err}") from None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``messages`` with the Hermes tool description in their system message when the template renders none."""
        if self.system_tools is None:
            return list(messages)
        if messages and messages[0]["role"] == "system":
            first = dict(messages[0], content=f"{messages[0]['content']}\n\n{self.system_tools}")
            return [first, *messages[1:]]
        return [{"role": "system", "content": self.system_tools}, *messages]

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.encode(self.render(self.prompt_messages(messages), True))

    def message_ids(self, new: list[dict[str, Any]], tool: str | None = None) -> list[int]:
        """The tokens after a model turn's EOS: the template's glue, ``new`` messages, the next generation prompt.
        ``tool``: the tool the turn called, for tool results (the stand-in turn calls it, without arguments: some
        templates write a result's header from its call; one call, as some templates allow no more)."""
        stand_in = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "x"}]
        if tool is not None:
            stand_in[1] = {**call_message([ToolCall(tool, {})]), "content": "x"}
        key = tool
        if key not in self._prefixes:
            ids = self.encode(self.render(stand_in, False))
            ends = [i for i, t in enumerate(ids) if t == self.tokenizer.eos_token_id]
            if not ends:
                raise UserError(
                    f"environment: the chat template of {self.where} does not end an assistant message with the "
                    f"tokenizer's EOS token {self.tokenizer.eos_token!r}, which ends a model turn: set the tokenizer's "
                    "eos_token to the template's end-of-turn token"
                )
            self._prefixes[key] = (ids, ends[-1] + 1)
        prefix, cut = self._prefixes[key]
        extended = self.encode(self.render(stand_in + new, True))
        if extended[:cut] != prefix[:cut]:
            raise UserError(
                f"environment: the chat template of {self.where} renders a conversation's earlier messages "
                "differently once a message follows (not prefix-preserving), so an episode's tokens cannot grow "
                "turn by turn: use a template without that (e.g. TRL's *_training.jinja variants)"
            )
        return extended[cut:]

    # --- tools ------------------------------------------------------------------------------------------
    def parse(self, text: str) -> ParsedReply:
        """The tool calls of a reply (none when the run has no tools)."""
        return self.parse_fn(text) if self.parse_fn is not None else ParsedReply(text.strip())

    def tool_messages(self, results: list[ToolResult]) -> list[dict[str, Any]]:
        """The messages carrying ``results`` back: tool messages (in ``<tool_response>`` blocks when the tools were
        described by us), or one user message of such blocks where the template renders no tool role."""
        if self.system_tools is None and self.tool_role:
            return [{"role": "tool", "name": r.name, "content": r.text} for r in results]
        blocks = [f"<tool_response>\n{r.text}\n</tool_response>" for r in results]
        if self.tool_role:
            return [{"role": "tool", "name": r.name, "content": b} for r, b in zip(results, blocks)]
        return [{"role": "user", "content": "\n".join(blocks)}]

    def _renders_tools(self) -> bool:
        try:
            text = self.render([{"role": "user", "content": "hi"}], True, tools=[_PROBE_SCHEMA])
        except Exception:  # noqa: BLE001 - a template error: it cannot render tools
            return False
        return _PROBE.name in text

    def _renders_tool_role(self) -> bool:
        conversation = [
            {"role": "user", "content": "hi"},
            call_message([_PROBE]),
            {"role": "tool", "name": _PROBE.name, "content": _PROBE_RESULT},
        ]
        try:
            return _PROBE_RESULT in self.render(conversation, True, tools=[])
        except Exception:  # noqa: BLE001 - a template that refuses the role
            return False

    def _choose_format(self, setting: str) -> str:
        if setting != AUTO_FORMAT:
            if not self.renders_tools and setting != "hermes":
                logger.warning(
                    "environment: the chat template of %s renders no tools: they are described in a system message "
                    "in the Hermes format, but calls are read as %s (environment.tool_call_format)",
                    self.where,
                    setting,
                )
            return setting
        if not self.renders_tools:
            logger.info(
                "environment: the chat template of %s renders no tools: they are described in a system message in "
                "the Hermes format (<tool_call>{json}</tool_call>), results come back in <tool_response> blocks",
                self.where,
            )
            return "hermes"
        user = [{"role": "user", "content": "hi"}]
        try:
            before = self.render(user, True)
            after = self.render([*user, call_message([_PROBE])], False)
        except Exception as err:  # noqa: BLE001 - the template's own error
            raise UserError(
                f"environment: the chat template of {self.where} cannot render an assistant tool call ({err}); set "
                f"environment.tool_call_format to one of {', '.join(TOOL_CALL_FORMATS)}"
            ) from None
        written = after[len(os.path.commonprefix([before, after])) :]  # the call, as the template writes it
        written = written.split(self.tokenizer.eos_token)[0]
        found = detect_format(written, _PROBE)
        if found is None:
            raise UserError(
                f"environment: the chat template of {self.where} writes a tool call as {written.strip()[:200]!r}, "
                f"which no registered tool-call parser reads ({', '.join(TOOL_CALL_FORMATS)}): set "
                "environment.tool_call_format, or register a parser (llm/alignment/ppo/agent/parsers.py)"
            )
        logger.info("environment: tool calls in the %s format (read from the chat template of %s)", found, self.where)
        return found
