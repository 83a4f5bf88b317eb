"""Multi-turn episodes (llm/alignment/ppo/agent/): which tokens train, by hand, with a scripted policy whose
``generate`` returns fixed ids, on SmolLM2's tokenizer and chat template (plain ChatML: the tools are described in
a Hermes system message); cuts; tool calls and their errors; every environment fault and ``on_error``."""

import logging

import pytest
from transformers import AutoTokenizer

from llm.alignment.ppo.agent.episode import Task, episode_metrics
from llm.alignment.ppo.agent.runner import EpisodeRunner
from llm.alignment.ppo.agent.source import episode_samples
from llm.settings.environment import EnvironmentConfig
from llm.utils.errors import UserError
from llm.utils.gguf import smollm2_dir

SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(smollm2_dir())


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


class ScriptedPolicy:
    """``generate`` answers call n's i-th context with ``replies[n][i]``: a text (its ids + EOS), or ids as given."""

    def __init__(self, tok, replies):
        self.tok, self.replies, self.calls = tok, replies, []

    def generate(self, prompt_ids, **settings):
        self.calls.append(([list(p) for p in prompt_ids], settings))
        out = []
        for r in self.replies[len(self.calls) - 1][: len(prompt_ids)]:
            out.append(r if isinstance(r, list) else ids(self.tok, r) + [self.tok.eos_token_id])
        return out


SAMPLING = {"num_samples": 2, "max_new_tokens": 64, "do_sample": True, "top_p": 1.0, "top_k": 0, "seed": 100}


def tasks(tok, *questions):
    out = []
    for q in questions:
        messages = [{"role": "user", "content": q}]
        prompt = ids(tok, tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
        out.append(Task({"src": q, "tgt": None}, messages, prompt))
    return out


def run(tok, replies, questions=("q1",), k=1, stop_ids=None, **env):
    env.setdefault("max_episode_tokens", 512)
    config = EnvironmentConfig(**env)
    config.check("test")
    runner = EpisodeRunner(config, tok, max_response_length=64, stop_ids=stop_ids)
    policy = ScriptedPolicy(tok, replies)
    try:
        return runner.run(policy, tasks(tok, *questions), k, dict(SAMPLING)), policy
    finally:
        runner.close()


def test_trained_tokens_are_the_sampled_ones_and_the_rendered_messages(tok):
    eos = tok.eos_token_id
    # the model's first turn in ids no tokenizer would produce for its text ("gu" "ess" as single characters)
    odd = [*ids(tok, "g"), *ids(tok, "u"), *ids(tok, "ess"), eos]
    assert odd != ids(tok, "guess") + [eos]
    rollout, policy = run(tok, [[odd], ["fine"]], name_or_path="tests.agent_envs:Echo", kwargs={"turns": 2})
    (ep,) = rollout.episodes
    prompt = ids(tok, f"{SYSTEM}<|im_start|>user\nstart q1<|im_end|>\n<|im_start|>assistant\n")
    between = ids(tok, "\n<|im_start|>user\nobs 1<|im_end|>\n<|im_start|>assistant\n")  # written by hand
    second = ids(tok, "fine") + [eos]
    assert ep.prompt_ids == prompt
    assert ep.response_ids == odd + between + second
    assert ep.action_mask == [1] * len(odd) + [0] * len(between) + [1] * len(second)
    assert ep.turn_ends == [len(odd) - 1, len(odd) + len(between) + len(second) - 1]
    assert ep.turn_rewards == [0.1, 0.2]  # Echo: turn k earns k / 10
    assert ep.cut is None and not ep.failed
    # what the model saw at its second turn: exactly the tokens so far
    assert policy.calls[1][0] == [prompt + odd + between]
    assert [c[1]["seed"] for c in policy.calls] == [100, 100 + 7919]
    assert all(c[1]["num_samples"] == 1 for c in policy.calls)
    # the tokens are the conversation the template renders (the model's odd ids decode to the same text)
    conversation = [
        {"role": "user", "content": "start q1"},
        {"role": "assistant", "content": "guess"},
        {"role": "user", "content": "obs 1"},
        {"role": "assistant", "content": "fine"},
    ]
    rendered = tok.apply_chat_template(conversation, tokenize=False)
    assert tok.decode(ep.prompt_ids + ep.response_ids) + "\n" == rendered
    record = ep.record()
    assert [t["role"] for t in record["turns"]] == ["user", "assistant", "user", "assistant", "user"]
    assert record["turns"][1] == {"role": "assistant", "text": "guess", "reward": 0.1}
    assert record["cut"] is None and record["errors"] == []


def test_a_turn_ends_at_any_of_the_runs_stop_ids(tok):
    """A model whose generation config adds an EOS id (Qwen2.5-Instruct: <|endoftext|> after <|im_end|>): a turn
    ending with it is a finished turn, not one cut at max_response_length, and the generation is asked to stop
    there; the sample counts as ended. With the tokenizer's EOS only the first turn was cut."""
    eos, other = tok.eos_token_id, tok.convert_tokens_to_ids("<|endoftext|>")
    assert other not in (eos, None)
    first, second = ids(tok, "guess") + [other], ids(tok, "fine") + [other]
    env = {"name_or_path": "tests.agent_envs:Echo", "kwargs": {"turns": 2}}
    rollout, policy = run(tok, [[first], [second]], stop_ids=(eos, other), **env)
    (ep,) = rollout.episodes
    assert ep.cut is None and ep.model_turns == 2 and ep.turn_rewards == [0.1, 0.2]
    assert [c[1]["stop_ids"] for c in policy.calls] == [(eos, other)] * 2
    assert [t["text"] for t in ep.turns if t["role"] == "assistant"] == ["guess", "fine"]
    assert episode_samples([ep], tok, (eos, other)).ended.tolist() == [True]
    assert episode_samples([ep], tok, (eos,)).ended.tolist() == [False]
    (cut,) = run(tok, [[first]], stop_ids=None, **env)[0].episodes  # the tokenizer's EOS only
    assert cut.cut == "max_response_length" and cut.model_turns == 1


def test_groups_generate_together_and_keep_their_order(tok):
    replies = [["a", "b", "c", "d"], ["e", "f", "g", "h"]]
    rollout, policy = run(tok, replies, ("q1", "q2"), k=2, name_or_path="tests.agent_envs:Echo")
    assert [len(c[0]) for c in policy.calls] == [4, 4]  # one batched call per turn
    assert [ep.group for ep in rollout.episodes] == [0, 0, 1, 1]
    texts = [[t["text"] for t in ep.turns if t["role"] == "assistant"] for ep in rollout.episodes]
    assert texts == [["a", "e"], ["b", "f"], ["c", "g"], ["d", "h"]]
    assert "start q2" in rollout.episodes[2].turns[0]["text"]


def test_cut_by_max_turns_ends_at_the_last_model_token(tok):
    rollout, _ = run(tok, [["a"], ["b"]], name_or_path="tests.agent_envs:Echo", kwargs={"turns": 5}, max_turns=2)
    (ep,) = rollout.episodes
    assert ep.cut == "max_turns" and ep.model_turns == 2
    assert ep.action_mask[-1] == 1 and ep.response_ids[-1] == tok.eos_token_id
    assert ep.turns[-1] == {"role": "user", "text": "obs 2"}  # recorded, not appended
    assert episode_metrics(rollout.episodes)["episode/cut_max_turns"] == 1.0


def test_cut_by_max_episode_tokens_keeps_the_sampled_prefix(tok):
    prompt = len(ids(tok, f"{SYSTEM}<|im_start|>user\nstart q1<|im_end|>\n<|im_start|>assistant\n"))
    long_turn = ids(tok, " one two three four five six seven eight") + [tok.eos_token_id]
    rollout, policy = run(tok, [[long_turn]], name_or_path="tests.agent_envs:Echo", max_episode_tokens=prompt + 5)
    (ep,) = rollout.episodes
    assert policy.calls[0][1]["max_new_tokens"] == 5  # never more than the room left
    assert ep.response_ids == long_turn[:5] and ep.action_mask == [1] * 5
    assert ep.cut == "max_episode_tokens" and ep.turn_ends == [4]


def test_next_message_that_does_not_fit_cuts_before_it(tok):
    prompt = len(ids(tok, f"{SYSTEM}<|im_start|>user\nstart q1<|im_end|>\n<|im_start|>assistant\n"))
    rollout, _ = run(tok, [["a"]], name_or_path="tests.agent_envs:Echo", max_episode_tokens=prompt + 6)
    (ep,) = rollout.episodes
    assert ep.cut == "max_episode_tokens" and ep.response_ids == ids(tok, "a") + [tok.eos_token_id]


def test_turn_without_eos_is_cut_at_max_response_length(tok):
    rollout, _ = run(tok, [[ids(tok, "no end")]], name_or_path="tests.agent_envs:Echo")
    (ep,) = rollout.episodes
    assert ep.cut == "max_response_length" and ep.turn_rewards == [0.0]  # the environment never saw it


# --- tools -------------------------------------------------------------------------------------------------
def call(name, **arguments):
    import json

    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_tool_call_runs_and_its_result_is_a_tool_message(tok, caplog):
    caplog.set_level(logging.INFO)
    rollout, policy = run(
        tok, [[call("add", a=2, b=3)], ["The sum is 5."]], tools=["tests.agent_envs:add", "tests.agent_envs:divide"]
    )
    (ep,) = rollout.episodes
    assert "described in a system message in the Hermes format" in caplog.text
    prompt_text = tok.decode(policy.calls[0][0][0])
    assert "<tools>" in prompt_text and '"name": "add"' in prompt_text and "user\nq1<|im_end|>" in prompt_text
    first = ids(tok, call("add", a=2, b=3)) + [tok.eos_token_id]
    result = ids(tok, "\n<|im_start|>tool\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    final = ids(tok, "The sum is 5.") + [tok.eos_token_id]
    assert ep.response_ids == first + result + final
    assert ep.action_mask == [1] * len(first) + [0] * len(result) + [1] * len(final)
    assert ep.turn_rewards == [0.0, 0.0] and ep.tool_calls == 1 and ep.tool_errors == 0
    assert ep.turns[1]["tool_calls"] == [{"name": "add", "arguments": {"a": 2, "b": 3}}]
    assert ep.turns[1]["tool_results"] == [{"name": "add", "text": "5", "error": False}]
    assert ep.cut is None  # tools only: the answer without a call ended it


@pytest.mark.parametrize(
    "reply, message",
    [
        (call("mul", a=1, b=2), "Error: unknown tool 'mul'; the tools are add, divide"),
        (call("add", a=1), "Error: wrong arguments for add: missing a required argument: 'b'"),
        (call("add", a="1", b=2), "Error: wrong arguments for add: a must be integer, got '1'"),
        (call("divide", a=1, b=0), "Error: divide raised ZeroDivisionError: division by zero"),
        ('<tool_call>\n{"name": "add", "arguments": {"a": 1,}\n</tool_call>', "Error: the tool call is not valid JSON"),
        ("<tool_call>\n{}", "Error: the tool call has no closing </tool_call>"),
    ],
)
def test_bad_tool_calls_go_back_to_the_model(tok, reply, message):
    rollout, _ = run(tok, [[reply], ["sorry"]], tools=["tests.agent_envs:add", "tests.agent_envs:divide"])
    (ep,) = rollout.episodes
    (result,) = ep.turns[1]["tool_results"]
    assert result["error"] and result["text"].startswith(message)
    assert ep.tool_errors == 1 and not ep.failed and ep.model_turns == 2
    assert message.encode() in tok.decode(ep.response_ids).encode()


def test_tool_that_never_returns_times_out_and_the_batch_goes_on(tok):
    replies = [[call("sleep_forever", seconds=1), "plain"], ["gave up"]]
    rollout, _ = run(tok, replies, k=2, tools=["tests.agent_envs:sleep_forever"], step_timeout=0.5)
    hung, plain = rollout.episodes
    assert hung.turns[1]["tool_results"][0]["text"] == "Error: sleep_forever timed out (no answer within 0.5 s)"
    assert hung.tool_errors == 1 and hung.model_turns == 2 and plain.model_turns == 1


def test_tools_and_environment_combine(tok):
    replies = [[call("add", a=1, b=1)], ["2"], ["done"]]
    rollout, _ = run(tok, replies, name_or_path="tests.agent_envs:Echo", tools=["tests.agent_envs:add"])
    (ep,) = rollout.episodes
    # turn 1 called a tool (no environment step, reward 0); turns 2 and 3 were the environment's steps 1 and 2
    assert ep.turn_rewards == [0.0, 0.1, 0.2] and ep.tool_calls == 1 and ep.cut is None


# --- environment faults ------------------------------------------------------------------------------------
FAULTS = [
    ("raises", "step raised ValueError: broken step"),
    ("hangs", "step took longer than environment.step_timeout=0.5 s"),
    ("not_string", "step returned a message of type int, not a string"),
    ("nan", "step returned reward nan, not a finite float32 number"),
    ("huge_reward", "step returned reward 1e+39, not a finite float32 number"),
    ("huge_message", "step returned a message of 10485760 characters, more than environment.max_observation_chars"),
    ("exits", "step raised SystemExit: 3"),
    ("reset_raises", "reset raised RuntimeError: no such task"),
]


@pytest.mark.parametrize("fault, cause", FAULTS)
def test_each_fault_ends_its_episode_with_one_log_line(tok, caplog, fault, cause):
    caplog.set_level(logging.WARNING)
    env = {"name_or_path": "tests.agent_envs:Faulty", "kwargs": {"fault": fault}, "step_timeout": 0.5}
    # the environment fails on the "bad" task only: the other episode of the batch runs its three turns
    rollout, _ = run(tok, [["a", "b"], ["c"], ["d"]], ("bad", "good"), max_error_fraction=0.5, **env)
    failed, survived = rollout.episodes
    (line,) = [r.getMessage() for r in caplog.records if "on_error" in r.getMessage()]
    turn = 0 if fault == "reset_raises" else 1
    assert line.startswith(f"environment tests.agent_envs:Faulty: episode 0 (prompt 0 of the batch), turn {turn}: ")
    assert cause in line and line.endswith("on_error=zero: it ends with reward 0")
    assert failed.failed and len(failed.errors) == 1 and failed.errors[0].startswith(f"turn {turn}: {cause}")
    assert failed.turn_rewards == [0.0] * failed.model_turns
    if fault == "reset_raises":  # nothing sampled: a stand-in EOS that does not train
        assert failed.response_ids == [tok.eos_token_id] and failed.action_mask == [0] and failed.turn_ends == []
        assert failed.prompt_ids == tasks(tok, "bad")[0].prompt_ids
    else:
        assert failed.action_mask[-1] == 1 and failed.model_turns == 1
    assert not survived.failed and survived.turn_rewards == [0.1, 0.2, 0.3]
    metrics = episode_metrics(rollout.episodes)
    assert metrics["episode/env_errors"] == 1.0 and metrics["episode/turns"] == (failed.model_turns + 3) / 2


def test_on_error_stop_stops_the_run_naming_the_episode(tok):
    with pytest.raises(UserError, match=r"episode 0 \(prompt 0 of the batch\), turn 1: step raised ValueError"):
        run(tok, [["a"]], ("bad",), name_or_path="tests.agent_envs:Faulty", kwargs={"fault": "raises"}, on_error="stop")


def test_more_failures_than_max_error_fraction_stop_the_run(tok):
    with pytest.raises(
        UserError,
        match=r"2 of 3 episodes of this step failed, more than .*max_error_fraction=0.5; "
        r"the last: episode 1, turn 1: step raised ValueError",
    ):
        run(
            tok,
            [["a", "b", "c"], ["d"], ["e"]],
            ("bad", "bad", "good"),
            name_or_path="tests.agent_envs:Faulty",
            kwargs={"fault": "raises"},
            max_error_fraction=0.5,
        )


# --- the tool sandbox --------------------------------------------------------------------------------------
def test_sandboxed_tools_run_in_a_limited_child_process(tok, caplog):
    import os
    import socket

    caplog.set_level(logging.INFO)
    server = socket.create_server(("127.0.0.1", 0))  # a port that accepts: reachable from this process
    port = server.getsockname()[1]
    try:
        replies = [
            [call("pid"), call("allocate", megabytes=512), call("connect", port=port), call("spin", seconds=1)],
            ["a", "b", "c", "d"],
        ]
        tools = [f"tests.agent_envs:{name}" for name in ("pid", "allocate", "connect", "spin")]
        rollout, _ = run(
            tok, replies, ("q1", "q2", "q3", "q4"), tools=tools, sandbox=True, sandbox_memory_mb=256, step_timeout=2.0
        )
    finally:
        server.close()
    results = [ep.turns[1]["tool_results"][0] for ep in rollout.episodes]
    child = int(results[0]["text"])
    assert not results[0]["error"] and child != os.getpid()
    assert results[1]["error"] and "MemoryError" in results[1]["text"]  # 512 MiB in a 256 MiB address space
    assert results[2]["error"] and "connected" not in results[2]["text"]  # no network in the child
    assert results[3]["error"] and results[3]["text"] == "Error: spin timed out (no answer within 2 s)"
    assert "environment.sandbox: tool workers run with" in caplog.text


def test_engine_log_probs_follow_the_tokens(tok):
    """rollout_log_probs / rollout_is_cap: the engine's log-probs of the model's tokens, 0.0 at the appended ones,
    cut with the turn."""
    import torch

    class WithLogProbs(ScriptedPolicy):
        def generate(self, prompt_ids, **settings):
            assert settings["with_log_probs"]
            rows = super().generate(prompt_ids, **settings)
            table = torch.tensor([[-(j + 1) / 10 for j in range(8)] for _ in rows])  # -0.1, -0.2, ... per position
            return rows, table

    config = EnvironmentConfig(name_or_path="tests.agent_envs:Echo", max_episode_tokens=512)
    runner = EpisodeRunner(config, tok, max_response_length=64)
    policy = WithLogProbs(tok, [["a"], ["b c"]])
    (ep,) = runner.run(policy, tasks(tok, "q1"), 1, dict(SAMPLING), with_log_probs=True).episodes
    first, second = ids(tok, "a") + [tok.eos_token_id], ids(tok, "b c") + [tok.eos_token_id]
    between = len(ep.response_ids) - len(first) - len(second)
    expected = [-(j + 1) / 10 for j in range(len(first))] + [0.0] * between
    expected += [-(j + 1) / 10 for j in range(len(second))]
    assert ep.logprobs == pytest.approx(expected) and len(ep.logprobs) == len(ep.response_ids)
