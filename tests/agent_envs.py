"""Scripted environments and tools for the agent tests (imported by name, as a config names them:
``tests.agent_envs:Echo``)."""

import math
import os
import signal
import socket
import time


class Echo:
    """Turn k (1-based) earns reward k / 10; answers "obs k"; done after ``turns`` steps."""

    def __init__(self, turns: int = 2):
        self.turns, self.k = turns, 0

    def reset(self, task):
        return f"start {task['src']}"

    def step(self, action):
        self.k += 1
        return f"obs {self.k}", self.k / 10, self.k >= self.turns


class Faulty(Echo):
    """Echo that goes wrong (``fault``, at its ``at``-th step) in one of the ways the runner must survive, on tasks
    whose ``src`` is "bad" only."""

    def __init__(self, fault: str, at: int = 1, turns: int = 3):
        super().__init__(turns)
        self.fault, self.at = fault, at

    def reset(self, task):
        self.bad = task["src"] == "bad"
        if self.bad and self.fault == "reset_raises":
            raise RuntimeError("no such task")
        return super().reset(task)

    def step(self, action):
        message, reward, done = super().step(action)
        if not self.bad or self.k != self.at:
            return message, reward, done
        if self.fault == "raises":
            raise ValueError("broken step")
        if self.fault == "hangs":
            time.sleep(3600)
        if self.fault == "not_string":
            return 42, reward, done
        if self.fault == "nan":
            return message, math.nan, done
        if self.fault == "huge_reward":
            return message, 1e39, done
        if self.fault == "huge_message":
            return "x" * (10 << 20), reward, done
        if self.fault == "exits":
            raise SystemExit(3)
        return message, reward, done


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def divide(a: float, b: float) -> float:
    """Divide a by b.

    Args:
        a: the dividend
        b: the divisor
    """
    return a / b


def sleep_forever(seconds: int) -> str:
    """Never returns.

    Args:
        seconds: ignored
    """
    while True:
        time.sleep(1)


def spin(seconds: int) -> str:
    """Burns CPU.

    Args:
        seconds: ignored
    """
    while True:
        pass


def allocate(megabytes: int) -> int:
    """Allocates memory.

    Args:
        megabytes: how much
    """
    return len(bytearray(megabytes << 20))


def connect(port: int) -> str:
    """Opens a TCP connection to this machine.

    Args:
        port: the port
    """
    with socket.create_connection(("127.0.0.1", port), timeout=2):
        return "connected"


def pid() -> int:
    """The process id that runs the tool."""
    return os.getpid()


def always_one(prompt, response, reference):
    """A rule reward that pays 1 whatever the answer."""
    return 1.0


class SignalOnce(Echo):
    """Echo whose ``at``-th step call in this process sends SIGTERM to the process itself, mid-episode, once per
    ``marker`` file (created then): a run resumed with the same config is not signalled again."""

    calls = 0  # step calls in this process, over every episode

    def __init__(self, marker: str, at: int, turns: int = 2):
        super().__init__(turns)
        self.marker, self.at = marker, at

    def step(self, action):
        SignalOnce.calls += 1
        if SignalOnce.calls == self.at and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGTERM)
        return super().step(action)
