"""Bundled environments, each a plain class following the protocol of the ``environment`` config section
(``Class(**environment.kwargs)`` built once per episode)::

    reset(task: dict) -> str                           # the prompt record -> the first user message
    step(action: str) -> tuple[str | None, float, bool] # the model's reply -> (next user message or None, reward, done)

- ``calculator.py``: ``CalculatorTask``, arithmetic beyond a small model's head with the ``calculator`` tool;
- ``guessing.py``: ``GuessingGame``, guess a secret integer from "higher" / "lower" feedback.

Adapters to outside sources of tasks and rewards are in ``llm/alignment/ppo/agent/adapters/``.
"""
