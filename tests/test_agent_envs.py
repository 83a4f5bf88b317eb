"""The bundled environments (calculator tool task, guessing game), the reasoning-gym adapter and the math_verify
rule, by hand: values worked out here, scripted episodes, refusals."""

from __future__ import annotations

import json
import os
import threading

import pytest

from llm.alignment.ppo.agent.adapters.reasoning_gym import ReasoningGymTask
from llm.alignment.ppo.agent.envs.calculator import (
    MAX_EXPRESSION_CHARS,
    CalculatorError,
    CalculatorTask,
    calculator,
    evaluate,
)
from llm.alignment.ppo.agent.envs.guessing import GuessingGame, last_integer
from llm.alignment.ppo.rewards.rule_functions import math_verify
from llm.data import make_calculator, make_guessing, make_reasoning_gym
from llm.utils.errors import UserError
from tests.helpers import ROOT


@pytest.mark.parametrize(
    "expression, value",
    [
        ("4821 * 317", "1528257"),  # 4821 * 300 + 4821 * 17 = 1446300 + 81957
        ("(1 + 2) * 3", "9"),
        ("10 - 20", "-10"),
        ("7 / 2", "3.5"),
        ("6 / 3", "2"),
        ("1 / 3", "0.3333333333"),
        ("2^10", "1024"),
        ("-2 ** 2", "-4"),  # the power binds first, as in Python and on paper
        ("2 ** -2", "0.25"),
        ("3 × 4 ÷ 2", "6"),
        ("10 ** 18", "1000000000000000000"),
    ],
)
def test_calculator_values(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(
    "expression, reason",
    [
        ("__import__('os').system('true')", "not allowed"),
        ("x + 1", "not allowed"),
        ("(1).real", "not allowed"),
        ("[1, 2]", "not allowed"),
        ("1 if 1 else 2", "not allowed"),
        ("7 // 2", "not allowed"),
        ("7 % 2", "not allowed"),
        ("True + 1", "not allowed"),
        ("'a' * 3", "not allowed"),
        ("1,234", "not allowed"),
        ("lambda: 1", "not allowed"),
        ("1 +", "cannot read"),
        ("", "empty"),
        ("1 / 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("(-8) ** 0.5", "not a real number"),
        ("9" * 19, "larger than"),  # a literal over 1e18
        ("10 ** 19", "larger than"),
        ("3 ** 40", "larger than"),  # 1.2e19, caught before it is computed
        ("2 ** 65", "exponent"),
        ("9 ** 9 ** 9", "exponent"),  # 9 ** 387420489: never computed
        ("1e308 * 10", "larger than"),
        ("+".join(["1"] * 40), "too long"),  # 79 syntax nodes
        ("1" * (MAX_EXPRESSION_CHARS + 1), "characters"),
    ],
)
def test_calculator_refuses_unsafe_or_oversized_input(expression, reason):
    answer = calculator(expression)
    assert answer.startswith("error: ") and reason in answer, answer
    with pytest.raises(CalculatorError, match=reason):
        evaluate(expression)


def test_calculator_is_a_tool_with_a_json_schema():
    """The episode loop describes tools to the model from their type hints and docstring (transformers'
    get_json_schema, what chat templates take): the docstring must say what the argument is."""
    from transformers.utils import get_json_schema

    schema = get_json_schema(calculator)["function"]
    assert schema["name"] == "calculator"
    assert schema["parameters"]["properties"]["expression"]["type"] == "string"
    assert schema["parameters"]["required"] == ["expression"]
    with pytest.raises(CalculatorError, match="string"):
        evaluate(12)


def test_calculator_task_rewards_the_final_answer():
    task = {"src": "What is 4821 * 317?", "tgt": "1528257"}
    env = CalculatorTask()
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("1528257")
    assert env.reset(task) == "What is 4821 * 317?"
    assert env.step("The calculator says 1,528,257. The answer is 1528257.") == (None, 1.0, True)
    env.reset(task)
    assert env.step("The answer is 1528256.") == (None, 0.0, True)
    env.reset(task)
    assert env.step("1528257 is what 4821 * 317 makes") == (None, 0.0, True)  # the last number counts: 317
    with pytest.raises(UserError, match="'tgt'"):
        env.reset({"src": "What is 2 * 3?"})
    with pytest.raises(UserError, match="no number"):
        env.reset({"src": "What is 2 * 3?", "tgt": "six"})


def test_last_integer():
    assert last_integer("I guess 40, no, 42.") == 42
    assert last_integer("-7") == -7
    assert last_integer("from 1-100 I pick 63") == 63
    assert last_integer("between 1-100") == 100  # a hyphen between numbers is no minus sign
    assert last_integer("**50**") == 50
    assert last_integer("4.5") is None and last_integer("no idea") is None


def test_guessing_game_feedback_and_rewards_over_a_scripted_game():
    task = {"src": "I am thinking of an integer from 1 to 100.", "tgt": "37", "low": 1, "high": 100}
    env = GuessingGame(max_guesses=5)
    assert env.reset(task) == task["src"]
    message, reward, done = env.step("My guess is 50.")
    assert (reward, done) == (0.0, False) and "50 is too high" in message and "lower" in message
    assert "4 guesses left" in message
    message, reward, done = env.step("25")
    assert (reward, done) == (0.0, False) and "25 is too low" in message and "higher" in message
    message, reward, done = env.step("hmm, no idea")
    assert (reward, done) == (0.0, False) and "no number" in message and "from 1 to 100" in message
    message, reward, done = env.step("500")
    assert (reward, done) == (0.0, False) and "outside the range" in message and "1 guess left" in message
    assert env.step("36") == (None, 0.0, True)  # the fifth guess, wrong: the game is over

    discounted = GuessingGame(max_guesses=5, turn_discount=0.5)
    discounted.reset(task)
    assert discounted.step("50")[1:] == (0.0, False)
    assert discounted.step("I say 37") == (None, 0.5, True)  # right on the second guess: 0.5 ** 1
    discounted.reset(task)
    assert discounted.step("37") == (None, 1.0, True)  # a new episode starts over


def test_guessing_game_seeded_secret():
    """A record with a seed and no secret: the secret is drawn from the range; exactly one guess wins, and the
    feedback of every other guess points towards it."""
    task = {"src": "Guess a number from 1 to 10.", "seed": 3, "low": 1, "high": 10}
    wins, directions = [], {}
    for guess in range(1, 11):
        env = GuessingGame()
        env.reset(task)
        message, reward, done = env.step(str(guess))
        if reward == 1.0:
            wins.append(guess)
            assert message is None and done
        else:
            directions[guess] = "higher" if "higher" in message else "lower"
    assert len(wins) == 1
    secret = wins[0]
    assert all(d == ("higher" if g < secret else "lower") for g, d in directions.items())
    with pytest.raises(UserError, match="outside"):
        GuessingGame().reset({"src": "Guess.", "tgt": "11", "low": 1, "high": 10})
    with pytest.raises(UserError, match="no secret"):
        GuessingGame().reset({"src": "Guess.", "low": 1, "high": 10})


def test_committed_prompts_are_the_generators_output():
    for module, names in (
        (make_calculator, ("calculator_train.jsonl", "calculator_dev.jsonl")),
        (make_guessing, ("guessing_train.jsonl", "guessing_dev.jsonl")),
    ):
        train, dev = module.make()
        directory = os.path.join(ROOT, "llm", "data", f"sample_{names[0].split('_')[0]}")
        for name, rows in zip(names, (train, dev)):
            with open(os.path.join(directory, name), encoding="utf-8") as f:
                assert [json.loads(line) for line in f] == rows, name
    train, dev = make_calculator.make()
    a, b = (int(x) for x in train[0]["src"].split("?")[0].removeprefix("What is ").split(" * "))
    assert train[0]["tgt"] == str(a * b) and 1000 <= a <= 9999 and 100 <= b <= 999
    assert not {r["src"] for r in train} & {r["src"] for r in dev}
    train, dev = make_guessing.make()
    assert all(r["low"] <= int(r["tgt"]) <= r["high"] for r in train + dev)
    assert not {(r["src"], r["tgt"]) for r in train} & {(r["src"], r["tgt"]) for r in dev}


def test_reasoning_gym_scores_right_and_wrong_answers_with_the_datasets_scorer(tmp_path):
    make_reasoning_gym.main(
        ["--dataset", "basic_arithmetic", "--seed", "1", "--train", "3", "--dev", "3"] + ["--out-dir", str(tmp_path)]
    )
    with open(tmp_path / "basic_arithmetic_train.jsonl", encoding="utf-8") as f:
        train = [json.loads(line) for line in f]
    with open(tmp_path / "basic_arithmetic_dev.jsonl", encoding="utf-8") as f:
        dev = [json.loads(line) for line in f]
    task = train[0]
    # reasoning-gym 0.1.25's first basic_arithmetic task for seed 1: 5 - 3 - 6 = -4
    assert task["src"] == "Calculate 5 - 3 - 6.\n" + make_reasoning_gym.INSTRUCTION and task["tgt"] == "-4"
    assert task["metadata"]["source_dataset"] == "basic_arithmetic"
    assert not {r["src"] for r in train} & {r["src"] for r in dev}

    env = ReasoningGymTask()
    assert env.reset(task) == task["src"]
    assert env.step("5 - 3 = 2, 2 - 6 = -4. <answer>-4</answer>") == (None, 1.0, True)
    env.reset(task)
    assert env.step("<answer>4</answer>") == (None, 0.0, True)

    retry = ReasoningGymTask(max_attempts=3)
    retry.reset(task)
    message, reward, done = retry.step("-4")  # no answer tags: no answer
    assert (reward, done) == (0.0, False) and "<answer>" in message and "2 attempts left" in message
    message, reward, done = retry.step("<answer>-2</answer>")
    assert (reward, done) == (0.0, False) and "not right" in message
    assert retry.step("<answer>-4</answer>") == (None, 1.0, True)

    bare = ReasoningGymTask(dataset="basic_arithmetic", answer_tag=None)  # a record without metadata
    bare.reset({"src": "Calculate 5 - 3 - 6.", "tgt": "-4"})
    assert bare.step(" -4 ") == (None, 1.0, True)
    with pytest.raises(UserError, match="basic_arithmetic"):
        ReasoningGymTask(dataset="basic_arithmetik").reset({"src": "Calculate 1 + 1.", "tgt": "2"})
    with pytest.raises(UserError, match="names no reasoning-gym dataset"):
        ReasoningGymTask().reset({"src": "Calculate 1 + 1.", "tgt": "2"})


@pytest.mark.parametrize(
    "response, reference, expected",
    [
        ("0.5", "\\boxed{1/2}", 1.0),
        ("The answer is $\\boxed{\\frac{1}{2}}$.", "0.5", 1.0),
        # TRL's accuracy_reward docstring example
        ("My answer is \\boxed{\\frac{1}{3}}", "\\frac{1}{3}", 1.0),
        ("My answer is \\boxed{\\frac{1}{2}}", "\\frac{1}{3}", 0.0),
        # math-verify's README example: equal sets written differently
        ("${1,2,3,4}$", "${1,3} \\cup {2,4}$", 1.0),
        ("The answer is 3.", "3", 1.0),
        ("\\boxed{4}", "3", 0.0),
    ],
)
def test_math_verify(response, reference, expected):
    assert math_verify("q", response, reference) == expected


def test_math_verify_refuses_a_missing_or_unreadable_reference_and_runs_in_a_thread():
    with pytest.raises(ValueError, match="reference"):
        math_verify("q", "0.5", None)
    with pytest.raises(ValueError, match="cannot read"):
        math_verify("q", "0.5", "no math here")
    out = []  # math-verify's own timeout (signal.alarm) works only in the main thread
    thread = threading.Thread(target=lambda: out.append(math_verify("q", "0.5", "\\frac{1}{2}")))
    thread.start()
    thread.join()
    assert out == [1.0]
