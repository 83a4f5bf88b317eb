"""``environment.sandbox``: tool calls in child processes with CPU, memory and time limits and no network.

Each worker is ``python -m llm.alignment.ppo.agent.sandbox`` (standard library only: it imports no torch), started
with the run's ``sys.path`` and working directory. Before it imports the tools it sets its address-space limit
(``sandbox_memory_mb``, ``RLIMIT_AS``) and leaves the network: a new user + network namespace (``unshare``; only a
loopback device, down) where the kernel allows it, else every socket refused (``socket.socket`` replaced: a
guard against accidents, not against C code; the log says which). For each call it sets a CPU-time limit
(``RLIMIT_CPU``: the process is killed by the kernel once it spends ``step_timeout`` more seconds of CPU), and the
parent kills it when no answer came within ``step_timeout`` of wall time; a killed worker is replaced. Requests and
answers are JSON lines on a pipe of their own (what a tool prints goes nowhere). Workers are reused across calls and
steps, at most ``max_workers`` at once.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
from typing import Any

from llm.alignment.ppo.agent.timeouts import StepTimeout

logger = logging.getLogger(__name__)

READY_TIMEOUT = 60.0  # seconds a new worker may take to start and import the tools


class SandboxError(Exception):
    """The call failed in the child (its exception, or the child died); the text says how."""


class Worker:
    def __init__(self, specs: list[str], memory_mb: int) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", __name__, json.dumps({"specs": specs, "memory_mb": memory_mb})],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            cwd=os.getcwd(),
        )
        hello = self._read(READY_TIMEOUT)
        if "ready" not in hello:
            self.kill()
            raise SandboxError(f"the sandbox worker did not start: {hello.get('error', hello)}")
        self.network = hello["ready"]

    def _read(self, timeout: float) -> dict[str, Any]:
        readable, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not readable:
            raise StepTimeout(f"no answer within {timeout:g} s")
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            cause = {-signal.SIGXCPU: "its CPU time limit", -signal.SIGKILL: "SIGKILL (memory?)"}.get(code, "")
            raise SandboxError(f"the tool's process died (exit code {code}{': ' + cause if cause else ''})")
        return json.loads(line)

    def call(self, spec: str, arguments: dict[str, Any], timeout: float) -> str:
        self.proc.stdin.write(json.dumps({"spec": spec, "arguments": arguments, "cpu": timeout}).encode() + b"\n")
        self.proc.stdin.flush()
        reply = self._read(timeout)
        if "error" in reply:
            raise SandboxError(reply["error"])
        return reply["result"]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class SandboxPool:
    """``call(spec, arguments, timeout) -> str`` in a worker; at most ``max_workers`` calls at once."""

    def __init__(self, specs: list[str], memory_mb: int, max_workers: int) -> None:
        self.specs, self.memory_mb = specs, memory_mb
        self.slots = threading.BoundedSemaphore(max_workers)
        self.idle: list[Worker] = []
        self.lock = threading.Lock()
        self.said_network = False

    def _take(self) -> Worker:
        with self.lock:
            if self.idle:
                return self.idle.pop()
        worker = Worker(self.specs, self.memory_mb)
        if not self.said_network:
            self.said_network = True
            logger.info("environment.sandbox: tool workers run with %s", worker.network)
        return worker

    def call(self, spec: str, arguments: dict[str, Any], timeout: float) -> str:
        with self.slots:
            worker = self._take()
            try:
                result = worker.call(spec, arguments, timeout)
            except (StepTimeout, SandboxError, OSError, ValueError) as err:
                if isinstance(err, SandboxError) and worker.proc.poll() is None:
                    with self.lock:  # the tool raised: the worker itself is fine
                        self.idle.append(worker)
                else:
                    worker.kill()
                raise
            with self.lock:
                self.idle.append(worker)
            return result

    def close(self) -> None:
        with self.lock:
            workers, self.idle = self.idle, []
        for worker in workers:
            worker.kill()


# --- the child process --------------------------------------------------------------------------------
def _leave_network() -> str:
    """A new user + network namespace (no interface up), else sockets refused. Must run single-threaded."""
    import ctypes

    clone_newuser, clone_newnet = 0x10000000, 0x40000000
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(clone_newuser | clone_newnet) == 0:
            return "no network (own network namespace), limited memory and CPU time"
    except (OSError, AttributeError):
        pass
    import socket

    class NoSocket(socket.socket):
        def __init__(self, *args, **kwargs) -> None:
            raise PermissionError("no network in the tool sandbox")

    socket.socket = NoSocket  # type: ignore[misc]
    socket.create_connection = NoSocket  # type: ignore[assignment]
    return "sockets refused (no network namespace here), limited memory and CPU time"


def _serve(settings: dict[str, Any]) -> None:
    import resource

    from llm.alignment.ppo.agent.specs import import_object, result_text

    channel = os.fdopen(os.dup(1), "w", buffering=1)  # answers on a copy of stdout; fd 1 itself -> stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def answer(**reply: Any) -> None:
        channel.write(json.dumps(reply) + "\n")

    limit = settings["memory_mb"] << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    network = _leave_network()
    try:
        fns = {spec: import_object(spec) for spec in settings["specs"]}
    except BaseException as err:  # noqa: BLE001 - told to the parent
        answer(error=f"{type(err).__name__}: {err}")
        return
    answer(ready=network)
    for line in sys.stdin:
        request = json.loads(line)
        used = resource.getrusage(resource.RUSAGE_SELF)
        spent = used.ru_utime + used.ru_stime
        resource.setrlimit(resource.RLIMIT_CPU, (int(spent + request["cpu"]) + 1, resource.RLIM_INFINITY))
        try:
            answer(result=result_text(fns[request["spec"]](**request["arguments"])))
        except MemoryError:
            answer(error=f"MemoryError: the tool ran out of its {settings['memory_mb']} MiB")
        except BaseException as err:  # noqa: BLE001 - the tool's failure is an answer, the worker goes on
            answer(error=f"{type(err).__name__}: {err}")


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]))
