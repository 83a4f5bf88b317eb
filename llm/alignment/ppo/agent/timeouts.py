"""A call bounded in wall time, for environment steps and in-process tool calls."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class StepTimeout(Exception):
    """The call ran past its time limit; it may still be running in its (daemon) thread."""


def call_with_timeout(fn: Callable[[], Any], timeout: float, name: str = "step") -> Any:
    """``fn()``, or ``StepTimeout`` after ``timeout`` seconds. The call runs in a daemon thread of its own: Python
    cannot stop a thread, so a call that never returns is abandoned there (it holds no lock of ours, and does not
    keep the process alive at exit), and the caller goes on. Whatever ``fn`` raises is raised here."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - handed to the caller, whatever it is (SystemExit too)
            box["error"] = err

    thread = threading.Thread(target=run, name=f"agent-{name}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise StepTimeout(f"no answer within {timeout:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]
