"""The calculator tool task: arithmetic beyond a small model's head (3-4 digit products, ``llm/data/
make_calculator.py``) with a ``calculator(expression)`` tool.

The tool evaluates an expression by walking its syntax tree (``ast``), never with ``eval``: numbers, ``+ - * /
**``, unary signs and parentheses, nothing else (no names, calls, attributes, comparisons), within size limits:
the expression's length, its number of syntax nodes, every intermediate value's magnitude and a power's
exponent. ``^``, ``×``, ``÷`` and ``−`` are read as ``**``, ``*``, ``/`` and ``-`` (what models write).
"""

from __future__ import annotations

import ast
import math
import operator

from llm.alignment.ppo.agent.envs.task import task_text
from llm.alignment.ppo.rewards.rule_functions import last_number
from llm.utils.errors import UserError

MAX_EXPRESSION_CHARS = 200
MAX_NODES = 64  # syntax-tree nodes: ~20 numbers and operators
MAX_ABS = 10**18  # every literal, intermediate and result
MAX_EXPONENT = 64

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_SPELLINGS = (("^", "**"), ("×", "*"), ("÷", "/"), ("−", "-"))


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message says why."""


def evaluate(expression: str) -> int | float:
    """The value of ``expression`` (``"4821 * 317"`` -> 1528257); CalculatorError for anything else."""
    if not isinstance(expression, str):
        raise CalculatorError(f"the expression must be a string, got {type(expression).__name__}")
    text = expression.strip()
    if not text:
        raise CalculatorError("the expression is empty")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression has {len(text)} characters, more than {MAX_EXPRESSION_CHARS}")
    for written, meant in _SPELLINGS:
        text = text.replace(written, meant)
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalculatorError(
            f"cannot read {expression!r}: write numbers with + - * / ** and parentheses, e.g. 4821 * 317"
        ) from None
    nodes = sum(1 for _ in ast.walk(tree))
    if nodes > MAX_NODES:
        raise CalculatorError(f"the expression is too long ({nodes} syntax nodes, at most {MAX_NODES})")
    return _value(tree.body)


def _checked(value: float) -> int | float:
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the result is not a finite number")
    if abs(value) > MAX_ABS:
        raise CalculatorError(f"a value is larger than {MAX_ABS:.0e} in magnitude")
    return value


def _power(base: float, exponent: float) -> int | float:
    if abs(exponent) > MAX_EXPONENT:
        raise CalculatorError(f"the exponent {exponent} is larger than {MAX_EXPONENT} in magnitude")
    if base == 0 and exponent < 0:
        raise CalculatorError("division by zero (0 to a negative power)")
    if base < 0 and not float(exponent).is_integer():
        raise CalculatorError("a negative number to a fractional power is not a real number")
    if abs(base) > 1 and exponent > 0 and exponent * math.log10(abs(base)) > math.log10(MAX_ABS) + 1:
        raise CalculatorError(f"the result is larger than {MAX_ABS:.0e} in magnitude")
    return base**exponent


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # not bool, complex or str
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _checked(_UNARY[type(node.op)](_value(node.operand)))
    if isinstance(node, ast.BinOp) and (type(node.op) in _BINARY or isinstance(node.op, ast.Pow)):
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise CalculatorError("division by zero")
        try:
            result = _power(left, right) if isinstance(node.op, ast.Pow) else _BINARY[type(node.op)](left, right)
        except (OverflowError, ZeroDivisionError) as err:
            raise CalculatorError(str(err)) from None
        return _checked(result)
    raise CalculatorError(
        f"{ast.unparse(node)!r} is not allowed: only numbers, + - * / ** and parentheses (no names, calls or "
        "other operators)"
    )


def format_number(value: float) -> str:
    """``1528257`` -> ``"1528257"``, ``2.0`` -> ``"2"``, ``1/3`` -> ``"0.3333333333"`` (10 decimals at most)."""
    if isinstance(value, float):
        if value.is_integer():
            return str(int(value))
        text = f"{value:.10f}".rstrip("0").rstrip(".")
        return "0" if text in ("", "-0") else text
    return str(value)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: The expression to evaluate, made of numbers, + - * / ** and parentheses, e.g. "4821 * 317".

    Returns:
        The value, e.g. "1528257", or "error: ..." saying why the expression was refused.
    """
    try:
        return format_number(evaluate(expression))
    except CalculatorError as err:
        return f"error: {err}"


class CalculatorTask:
    """The episode: the task's question (``src``) as the first user message; the model may call the
    ``calculator`` tool (the episode loop runs the calls and feeds back their results) and then answers. That
    answer, the model's first reply without a tool call, is the action of the one ``step``: reward
    ``correct_reward`` when its last number equals the task's ``tgt`` (``rule_functions.last_number``: "The
    answer is 1,528,257." reads 1528257), else ``wrong_reward``; the episode is then done."""

    def __init__(self, correct_reward: float = 1.0, wrong_reward: float = 0.0) -> None:
        self.correct_reward, self.wrong_reward = float(correct_reward), float(wrong_reward)
        self.answer: str | None = None

    def reset(self, task: dict) -> str:
        question = task_text(task, "src")
        self.answer = last_number(task_text(task, "tgt"))
        if self.answer is None:
            raise UserError(f"the task record {str(task)[:120]}: its 'tgt' holds no number; give the answer as one")
        return question

    def step(self, action: str) -> tuple[str | None, float, bool]:
        if self.answer is None:
            raise RuntimeError("CalculatorTask.step before reset")
        correct = last_number(action) == self.answer
        return None, self.correct_reward if correct else self.wrong_reward, True
