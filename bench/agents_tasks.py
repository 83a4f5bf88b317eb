"""The bundled agent tasks of ``bench_agents.py``: their settings, the chat template both trainers use, the prompt
files, the SFT demonstrations and the one held-out evaluator.

Tasks (``TASKS``): ``calculator`` (``CalculatorTask`` + the ``calculator`` tool, llm/data/sample_calculator/) and
``guessing`` (``GuessingGame``, higher / lower feedback as user messages, llm/data/sample_guessing/).

The chat template (``--template``):

- ``tools`` (default): SmolLM2's own tokens (ChatML, ``<|im_end|>`` = EOS) with Qwen2.5's ChatML template, the one
  TRL ships (``trl/chat_templates/qwen2_5.jinja``): it renders tools in the system message in the Hermes format and
  tool results as ``<|im_start|>user\\n<tool_response>...``. SmolLM2's own template renders no tools, which TRL's
  ``GRPOTrainer`` refuses ("does not support tool calling"); with this one both trainers render the same prompt
  token for token (checked by ``bench_agents.py``), and the SFT reader, which takes system / user / assistant
  messages only, can write a tool turn exactly as the template renders it (a user message of
  ``<tool_response>`` blocks).
- ``own``: SmolLM2's own template, as ``llm/config/smollm2/grpo_calculator_argument.json`` runs it: our trainer
  describes the tools in a system message in the Hermes format and sends results as ``tool`` messages
  (``<|im_start|>tool\\n<tool_response>...``). The SFT reader refuses the ``tool`` role, so the demonstrations
  carry them as user messages: one token differs from what the episodes render (``user`` for ``tool``). TRL does
  not run on it (its refusal is recorded).

Every record gets SmolLM2's default system sentence (``SYSTEM``) as an explicit system message, so that both
templates render the same system text and the tools are appended to it.
"""

from __future__ import annotations

import copy
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
TEMPLATES = ("tools", "own")


@dataclass(frozen=True)
class TaskSpec:
    name: str
    train: str
    dev: str
    env: str
    kwargs: dict[str, Any]
    tools: tuple[str, ...]
    max_turns: int
    max_response_length: int  # per model turn
    max_episode_tokens: int
    max_prompt_length: int
    trl_completion_tokens: int  # TRL's max_completion_length: every turn and tool result of an episode together
    extra: dict[str, Any] = field(default_factory=dict)


TASKS = {
    "calculator": TaskSpec(
        "calculator",
        "llm/data/sample_calculator/calculator_train.jsonl",
        "llm/data/sample_calculator/calculator_dev.jsonl",
        "llm.alignment.ppo.agent.envs.calculator:CalculatorTask",
        {},
        ("llm.alignment.ppo.agent.envs.calculator:calculator",),
        max_turns=3,
        max_response_length=48,
        max_episode_tokens=512,
        max_prompt_length=384,
        trl_completion_tokens=128,
    ),
    "guessing": TaskSpec(
        "guessing",
        "llm/data/sample_guessing/guessing_train.jsonl",
        "llm/data/sample_guessing/guessing_dev.jsonl",
        "llm.alignment.ppo.agent.envs.guessing:GuessingGame",
        {"max_guesses": 7, "turn_discount": 0.9},
        (),
        max_turns=7,
        max_response_length=16,
        max_episode_tokens=512,
        max_prompt_length=128,
        trl_completion_tokens=384,
    ),
}


def read_jsonl(path: str) -> list[dict]:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


# --------------------------------------------------------------------------------------------------------------
# The chat template and the tokenizer directory every side loads.
# --------------------------------------------------------------------------------------------------------------
def trl_template_path(name: str = "qwen2_5.jinja") -> str:
    """TRL's copy of a chat template: TRL's current release (.trl-current), else the venv's TRL."""
    local = os.path.join(ROOT, ".trl-current", "trl", "chat_templates", name)
    if os.path.isfile(local):
        return local
    import trl

    return os.path.join(os.path.dirname(trl.__file__), "chat_templates", name)


def tools_template(eos: str) -> str:
    """Qwen2.5's ChatML template with tools; for a tokenizer whose EOS is not ``<|im_end|>`` (the tiny test
    tokenizer) that token is replaced by its EOS (the other markup stays text)."""
    with open(trl_template_path(), encoding="utf-8") as f:
        text = f.read()
    return text if eos == "<|im_end|>" else text.replace("<|im_end|>", eos)


def make_tokenizer_dir(source: str, template: str, out: str) -> str:
    """``source``'s tokenizer with the ``template`` chat template, saved to ``out`` (every side loads it)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(source)
    if template == "tools":
        tok.chat_template = tools_template(tok.eos_token)
    tok.save_pretrained(out)
    return out


def trl_response_template(tok) -> None:
    """TRL parses tool calls with a response template it knows for Qwen2.5's template; for the tiny tokenizer's
    variant (another EOS) the same one with that EOS, set before TRL looks."""
    from trl.chat_template_utils import qwen2_5_chat_template, qwen3_template

    if tok.chat_template == qwen2_5_chat_template or getattr(tok, "response_template", None) is not None:
        return
    eos = re.escape(tok.eos_token).replace("\\", "\\\\")
    text = json.dumps(qwen3_template).replace("<\\\\|im_end\\\\|>", eos)
    tok.response_template = json.loads(text)


def messages_of(row: dict, src: str | None = None) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": src or row["src"]}]


def prompt_rows(rows: list[dict]) -> list[dict]:
    """The prompt records our trainer reads: the sample records with the system sentence (``system`` field)."""
    return [{**r, "system": SYSTEM} for r in rows]


# --------------------------------------------------------------------------------------------------------------
# Demonstrations for the SFT warm-up (multi-turn SFT records: system / user / assistant messages).
# --------------------------------------------------------------------------------------------------------------
GUESS_TOOL_SRC = (
    "I am thinking of an integer from {low} to {high}. Guess it with the guess tool, one integer per call. After each "
    "guess the tool tells you whether the number is higher or lower."
)


def binary_search(low: int, high: int, secret: int, max_guesses: int) -> list[int]:
    guesses = []
    while len(guesses) < max_guesses:
        g = (low + high) // 2
        guesses.append(g)
        if g == secret:
            break
        low, high = (g + 1, high) if g < secret else (low, g - 1)
    return guesses


def call_text(name: str, arguments: dict) -> str:
    """A Hermes tool call as the assistant writes it (what Qwen2.5's template renders for a call)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def system_with_tools(chat, messages: list[dict]) -> str:
    """The system message text an SFT record needs so that the template without tools renders the prompt as the
    episodes do with tools (the tools' description inside the system message)."""
    marker = "@@SYSTEM@@"
    withtools = chat.render(chat.prompt_messages(messages), False)
    plain = chat.tokenizer.apply_chat_template([{"role": "system", "content": marker}], tokenize=False)
    head, tail = plain.split(marker)
    if not (withtools.startswith(head) and tail in withtools[len(head) :]):
        raise RuntimeError("the template renders its system message in a way the demonstrations cannot copy")
    return withtools[len(head) : withtools.index(tail, len(head))]


def tool_result_message(chat, name: str, text: str) -> dict:
    """The tool result as an SFT user message: its text as the template writes it (``<tool_response>`` block)."""
    from llm.alignment.ppo.agent.tools import ToolResult

    (msg,) = chat.tool_messages([ToolResult(name, text)])
    content = msg["content"]
    if not content.startswith("<tool_response>"):  # Qwen2.5's template adds the block around a tool message
        content = f"<tool_response>\n{content}\n</tool_response>"
    return {"role": "user", "content": content}


def calculator_demo(row: dict, chat) -> dict:
    from llm.alignment.ppo.agent.envs.calculator import calculator

    expression = re.search(r"What is (.+?)\?", row["src"]).group(1)
    result = calculator(expression)
    system = system_with_tools(chat, messages_of(row))
    return {
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": row["src"]},
            {"role": "assistant", "content": call_text("calculator", {"expression": expression})},
            tool_result_message(chat, "calculator", result),
            {"role": "assistant", "content": result},
        ]
    }


def guessing_demo(row: dict, kwargs: dict) -> dict:
    """Binary search with the game's own feedback (GuessingGame.step) as the user's turns."""
    from llm.alignment.ppo.agent.envs.guessing import GuessingGame

    game = GuessingGame(**kwargs)
    game.reset(row)
    messages = messages_of(row)
    for g in binary_search(row["low"], row["high"], int(row["tgt"]), kwargs.get("max_guesses", 7)):
        messages.append({"role": "assistant", "content": str(g)})
        feedback, _, done = game.step(str(g))
        if done:
            break
        messages.append({"role": "user", "content": feedback})
    return {"messages": messages}


def guessing_tool_demo(row: dict, kwargs: dict, chat) -> dict:
    """TRL's variant of the game (a ``guess`` tool, GuessingTool): binary search through tool calls, then a
    final answer."""
    env = GuessingTool(**kwargs)
    env.reset(**row)
    src = GUESS_TOOL_SRC.format(**row)
    messages = [{"role": "system", "content": system_with_tools(chat, messages_of(row, src))}]
    messages.append({"role": "user", "content": src})
    for g in binary_search(row["low"], row["high"], int(row["tgt"]), kwargs.get("max_guesses", 7)):
        messages.append({"role": "assistant", "content": call_text("guess", {"number": g})})
        messages.append(tool_result_message(chat, "guess", env.guess(g)))
        if env.done:
            break
    messages.append({"role": "assistant", "content": f"The number is {int(row['tgt'])}."})
    return {"messages": messages}


class GuessingTool:
    """The guessing game for TRL's ``environment_factory``: TRL continues an episode only on tool calls, so the
    guesses are calls of the ``guess`` tool (the game's feedback is the tool's result) and the reward is the
    game's (``get_reward``). One instance per rollout, reset with the dataset row."""

    def __init__(self, max_guesses: int = 7, turn_discount: float = 0.9) -> None:
        from llm.alignment.ppo.agent.envs.guessing import GuessingGame

        self.game = GuessingGame(max_guesses=max_guesses, turn_discount=turn_discount)
        self.reward, self.done, self.guesses = 0.0, False, 0

    def reset(self, **row) -> None:
        self.game.reset({"src": "game", "tgt": row["tgt"], "low": row["low"], "high": row["high"]})
        self.reward, self.done, self.guesses = 0.0, False, 0

    def guess(self, number: int) -> str:
        """Guess the secret number.

        Args:
            number: The guess, an integer in the range.

        Returns:
            Whether the number is higher or lower than the guess, or that the guess is right.
        """
        if self.done:
            return "The game is over."
        self.guesses += 1
        message, reward, done = self.game.step(str(number))
        self.reward += reward
        self.done = done
        if done:
            return f"{number} is right!" if reward > 0 else "No guesses left: the game is over."
        return message

    def get_reward(self) -> float:
        return self.reward


# --------------------------------------------------------------------------------------------------------------
# The held-out evaluator: greedy episodes of a saved policy.
# --------------------------------------------------------------------------------------------------------------
def environment_config(spec: TaskSpec):
    from llm.settings.environment import EnvironmentConfig

    return EnvironmentConfig(
        name_or_path=spec.env,
        kwargs=dict(spec.kwargs),
        tools=list(spec.tools),
        max_turns=spec.max_turns,
        max_episode_tokens=spec.max_episode_tokens,
        step_timeout=10.0,
        on_error="zero",
        max_error_fraction=1.0,
    )


GREEDY = {"do_sample": False, "top_p": 1.0, "top_k": 0, "seed": 0}
# The policy's own behaviour at the training temperature (``PolicyModel`` samples at 1.0): what GRPO maximises.
SAMPLED = {"do_sample": True, "top_p": 1.0, "top_k": 0, "seed": 1}


def evaluate_episodes(
    model, tok, spec: TaskSpec, rows: list[dict], batch: int = 16, sampling: dict | None = None, samples: int = 1
) -> dict:
    """Our episode loop (``EpisodeRunner``, the one training runs) over ``rows``, ``samples`` episodes each
    (``sampling``: ``GREEDY`` by default, ``SAMPLED`` for the policy at temperature 1 with a fixed seed): the
    success rate (the environment's reward > 0: the right answer / the secret found), tool calls per episode,
    turns, cuts, and the first episodes' records."""
    from llm.alignment.ppo.agent.episode import Task
    from llm.alignment.ppo.agent.runner import EpisodeRunner
    from llm.alignment.ppo.roles import PolicyModel

    runner = EpisodeRunner(environment_config(spec), tok, spec.max_response_length)
    policy = PolicyModel(model, tok, 1.0, batch)
    episodes = []
    try:
        for i in range(0, len(rows), batch):
            tasks = []
            for r in rows[i : i + batch]:
                msgs = messages_of(r)
                tasks.append(Task({**r, "messages": msgs, "reference": r.get("tgt")}, msgs, []))
            episodes += runner.run(policy, tasks, samples, sampling or GREEDY).episodes
    finally:
        runner.close()
    wins = [sum(ep.turn_rewards) > 0 for ep in episodes]
    return {
        "success": sum(wins) / len(wins),
        "n": len(wins),
        "tool_call_rate": sum(ep.tool_calls > 0 for ep in episodes) / len(episodes),
        "tool_calls": sum(ep.tool_calls for ep in episodes) / len(episodes),
        "turns": sum(ep.model_turns for ep in episodes) / len(episodes),
        "cut": sum(ep.cut is not None for ep in episodes),
        "samples": [ep.record()["turns"][1:] for ep in episodes[:3]],
    }


def evaluate_guess_tool(model, tok, spec: TaskSpec, rows: list[dict], batch: int = 16) -> dict:
    """TRL's tool variant of the game (``GuessingTool``), greedy, with the same chat rendering as our episodes
    (``ChatFormat``: the template's tool description, token-exact turns): success = the secret found."""
    from transformers.utils import get_json_schema

    from llm.alignment.ppo.agent.chat import ChatFormat
    from llm.alignment.ppo.agent.tools import ToolResult
    from llm.alignment.ppo.roles import PolicyModel

    chat = ChatFormat(tok, [get_json_schema(GuessingTool().guess)], "hermes")
    policy = PolicyModel(model, tok, 1.0, batch)
    eos = tok.eos_token_id
    wins, calls, samples = [], [], []
    for i in range(0, len(rows), batch):
        part = rows[i : i + batch]
        envs = [GuessingTool(**spec.kwargs) for _ in part]
        for env, r in zip(envs, part):
            env.reset(**r)
        ids = [chat.prompt_ids(messages_of(r, GUESS_TOOL_SRC.format(**r))) for r in part]
        used = [0] * len(part)
        texts: list[list[str]] = [[] for _ in part]
        live = list(range(len(part)))
        for _ in range(spec.max_turns):
            if not live:
                break
            room = max(spec.trl_completion_tokens - used[j] for j in live)
            out = policy.generate(
                [ids[j] for j in live], num_samples=1, max_new_tokens=min(spec.max_response_length * 2, room), **GREEDY
            )
            still = []
            for j, turn in zip(live, out):
                ids[j] = ids[j] + turn
                used[j] += len(turn)
                body = turn[:-1] if turn and turn[-1] == eos else turn
                text = tok.decode(body, skip_special_tokens=False)
                texts[j].append(text)
                parsed = chat.parse(text)
                if not parsed.has_calls or envs[j].done or not turn or turn[-1] != eos:
                    continue
                results = []
                for c in parsed.calls:
                    try:
                        results.append(ToolResult("guess", envs[j].guess(**c.arguments)))
                    except TypeError as err:
                        results.append(ToolResult("guess", f"error: {err}", True))
                calls.append(len(results))
                new = chat.message_ids(chat.tool_messages(results), "guess")
                ids[j] = ids[j] + new
                used[j] += len(new)
                texts[j].append(results[-1].text)
                if not envs[j].done and used[j] < spec.trl_completion_tokens:
                    still.append(j)
            live = still
        wins += [env.reward > 0 for env in envs]
        samples += texts[: max(0, 3 - len(samples))]
    n = len(wins)
    return {"success": sum(wins) / n, "n": n, "tool_calls": sum(calls) / n, "samples": samples[:3]}


def load_policy(path: str, tokenizer_dir: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tokenizer_dir)


def copy_spec(spec: TaskSpec, **changes) -> TaskSpec:
    values = {k: copy.deepcopy(getattr(spec, k)) for k in spec.__dataclass_fields__}
    return TaskSpec(**{**values, **changes})
