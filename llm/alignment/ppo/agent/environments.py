"""The user's environment (``environment.name_or_path``): built once per episode, called with a time limit, its
answers checked.

The protocol (CONTRACT: issue 27)::

    class Environment:
        def __init__(self, **kwargs): ...                 # environment.kwargs
        def reset(self, task: dict) -> str: ...           # the prompt record -> the first user message
        def step(self, action: str) -> tuple[str | None, float, bool]: ...  # the model's reply -> (next user
                                                          # message or None, reward, done)
        def close(self) -> None: ...                      # optional: once the episode ended, for any reason
        @classmethod
        def prepare(cls, **kwargs) -> None: ...           # optional: once, before the run's first episode (start
                                                          # a server, download a task set: not bounded by step_timeout)

``step`` is called once per model turn, with the model's reply (its text, special tokens left out) when the reply
makes no tool call: a turn's tool calls are run by the loop, which then lets the model go on.

A Python environment is trusted code, as a rule reward is: it runs in this process, in a thread of its own per call
(``call_with_timeout``). What it does wrong is an ``EnvironmentFault`` of its episode, and ``environment.on_error``
decides what follows: it raised (``SystemExit`` too), took longer than ``step_timeout``, returned a message that is
not a string or is longer than ``max_observation_chars``, a reward that is not a finite number within float32 (NaN,
1e39), a ``done`` that is not a bool, or no message (None) without being done.
"""

from __future__ import annotations

import inspect
import math
import numbers
from typing import Any

from llm.alignment.ppo.agent.specs import SpecError, import_object
from llm.alignment.ppo.agent.timeouts import StepTimeout, call_with_timeout
from llm.utils.errors import UserError

# rewards become float32 tensors: a finite Python float beyond this (1e39) would become inf there
FLOAT32_MAX = 3.4028234663852886e38


class EnvironmentFault(Exception):
    """The environment failed one episode; the text is the cause (for the log line and the episode record)."""


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool) or type(value).__name__ == "bool_"  # numpy's bool, as gym-style code returns


class Environments:
    """Builds and calls the environment class ``spec``: ``start(task) -> (env, first message)``, ``step(env, reply)
    -> (message | None, reward, done)``, each bounded by ``timeout`` seconds and checked."""

    def __init__(self, spec: str, kwargs: dict[str, Any], timeout: float, max_chars: int) -> None:
        try:
            self.cls = import_object(spec)
        except SpecError as err:
            raise UserError(f"environment.name_or_path: {err}") from None
        if not inspect.isclass(self.cls):
            raise UserError(f"environment.name_or_path: {spec!r} is not a class (with reset(task) and step(action))")
        missing = [m for m in ("reset", "step") if not callable(getattr(self.cls, m, None))]
        if missing:
            raise UserError(
                f"environment.name_or_path: {spec!r} has no {' and no '.join(missing)} method: an environment has "
                "reset(task) -> str and step(action) -> (str | None, float, bool)"
            )
        self.spec, self.kwargs, self.timeout, self.max_chars = spec, kwargs, timeout, max_chars
        self.closes = callable(getattr(self.cls, "close", None))
        prepare = getattr(self.cls, "prepare", None)
        if callable(prepare):
            try:
                prepare(**kwargs)
            except BaseException as err:  # noqa: BLE001 - the environment's own setup failed: the run cannot start
                raise UserError(
                    f"environment.name_or_path: {spec}.prepare raised {type(err).__name__}: {err}"
                ) from None

    def _call(self, fn, what: str) -> Any:
        try:
            return call_with_timeout(fn, self.timeout, what)
        except StepTimeout:
            raise EnvironmentFault(f"{what} took longer than environment.step_timeout={self.timeout:g} s") from None
        except EnvironmentFault:
            raise
        except BaseException as err:  # noqa: BLE001 - the environment's failure is its episode's, never the run's
            raise EnvironmentFault(f"{what} raised {type(err).__name__}: {err}") from None

    def _message(self, value: Any, what: str) -> str:
        if not isinstance(value, str):
            raise EnvironmentFault(f"{what} returned a message of type {type(value).__name__}, not a string")
        if len(value) > self.max_chars:
            raise EnvironmentFault(
                f"{what} returned a message of {len(value)} characters, more than environment.max_observation_chars="
                f"{self.max_chars}"
            )
        return value

    def start(self, task: dict[str, Any]) -> tuple[Any, str]:
        """A new environment for ``task`` and its first user message."""

        def build_and_reset():
            env = self.cls(**self.kwargs)
            return env, env.reset(task)

        env, first = self._call(build_and_reset, "reset")
        return env, self._message(first, "reset")

    def close(self, env: Any) -> str | None:
        """``env.close()`` when the class has one; what went wrong, if anything (the episode has ended: logged only)."""
        if not self.closes:
            return None
        try:
            self._call(env.close, "close")
        except EnvironmentFault as err:
            return str(err)
        return None

    def step(self, env: Any, action: str) -> tuple[str | None, float, bool]:
        out = self._call(lambda: env.step(action), "step")
        if not isinstance(out, (tuple, list)) or len(out) != 3:
            raise EnvironmentFault(f"step returned {type(out).__name__} {str(out)[:80]!r}, not (message, reward, done)")
        message, reward, done = out
        if not _is_bool(done):
            raise EnvironmentFault(f"step returned done={done!r} ({type(done).__name__}), not a bool")
        if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
            raise EnvironmentFault(f"step returned reward {reward!r} ({type(reward).__name__}), not a number")
        reward = float(reward)
        if not math.isfinite(reward) or abs(reward) > FLOAT32_MAX:
            raise EnvironmentFault(f"step returned reward {reward!r}, not a finite float32 number")
        if message is None:
            if not done:
                raise EnvironmentFault(
                    "step returned no message (None) but done=False: the model has nothing to answer"
                )
            return None, reward, True
        return self._message(message, "step"), reward, bool(done)
