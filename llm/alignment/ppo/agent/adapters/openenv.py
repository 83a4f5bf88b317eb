"""OpenEnv (``pip install openenv-core``; Meta's environment servers): an environment server reached at a URL, or
started here from its ASGI app, behind the protocol of the bundled environments.

Wire protocol (openenv-core 0.3.0, ``openenv.core.env_server.http_server``): one WebSocket session per episode at
``<url>/ws`` (the HTTP ``/reset`` and ``/step`` endpoints build a fresh environment for every call, so they keep no
episode); ``{"type": "reset", "data": {"seed": ...}}`` and ``{"type": "step", "data": <action>}`` are answered
``{"type": "observation", "data": {"observation": {...}, "reward": number | null, "done": bool}}`` or ``{"type":
"error", "data": {"message", "code"}}``; ``{"type": "close"}`` ends the session. It is spoken here with the
``websockets`` package's blocking client, not openenv's ``EnvClient`` (an asyncio client running a thread of its
own per client), so that each call is bounded in time and every answer is checked before use: the server is
untrusted. An answer over ``max_message_bytes``, not JSON (NaN and Infinity included), of the wrong shape or
types, with a reward that is not a finite float32 number, or an observation text over ``max_text_chars`` is an
``OpenEnvFailure`` naming the server, as is no answer within ``timeout`` seconds.
"""

from __future__ import annotations

import atexit
import contextlib
import http.client
import json
import math
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse

from llm.alignment.ppo.agent.envs.task import task_text
from llm.alignment.ppo.interfaces import RoleFailure
from llm.utils.errors import UserError

FLOAT32_MAX = 3.4028234663852886e38
LOOPBACK = ("localhost", "127.0.0.1", "::1")
INSTALL = "pip install openenv-core==0.3.0 (or pip install --no-deps openenv-core==0.3.0 fastapi uvicorn websockets)"


class OpenEnvFailure(RoleFailure):
    """An OpenEnv server that failed, timed out or answered something unusable; the message names the server."""


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


def check_reward(value: object, where: str) -> float:
    """A step's reward: null (0.0), or a finite number within float32's range (a bool counts as 0 / 1)."""
    if value is None:
        return 0.0
    if not isinstance(value, (bool, int, float)) or not math.isfinite(value) or abs(value) > FLOAT32_MAX:
        raise OpenEnvFailure(f"{where} answered the reward {value!r:.80}; a reward must be a finite float32 number")
    return float(value)


def ws_url(url: str) -> str:
    """``http(s)://`` or ``ws(s)://host:port[/path]`` -> the session endpoint ``ws(s)://host:port[/path]/ws``."""
    parts = urllib.parse.urlsplit(url)
    scheme = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}.get(parts.scheme.lower())
    if scheme is None or not parts.hostname or parts.query or parts.fragment:
        raise UserError(
            f"OpenEnv url {url!r}: give the server's address as http://host:port (or ws://, https://, wss://), "
            "without a query"
        )
    return urllib.parse.urlunsplit((scheme, parts.netloc, parts.path.rstrip("/") + "/ws", "", ""))


class _Server:
    """A local OpenEnv server process started from ``command`` (``{port}`` is replaced by a free port), shared by
    every episode of this process that names the same command, stopped at exit (``stop_servers``)."""

    def __init__(self, command: list[str], start_timeout: float) -> None:
        self.command, self.process = command, None
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - the server's output, kept while it runs
        for _ in range(3):  # the free port may be taken between our probe and the server's bind: try another
            self.port = _free_port()
            self.log.seek(0)
            self.log.truncate()
            argv = [part.replace("{port}", str(self.port)) for part in command]
            try:
                self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log)
            except OSError as err:
                raise OpenEnvFailure(f"could not start the OpenEnv server {argv}: {err}") from None
            if self._wait_healthy(start_timeout):
                self.url = f"http://127.0.0.1:{self.port}"
                return
            if self.process.poll() is None:
                tail = self._log_tail()
                self.stop()
                raise OpenEnvFailure(
                    f"the OpenEnv server {argv} did not answer GET /health within {start_timeout:g}s "
                    f"(start_timeout); its output ends: {tail!r}"
                )
            if "address already in use" not in self._log_tail().lower():
                break
        tail = self._log_tail()
        self.stop()
        raise OpenEnvFailure(
            f"the OpenEnv server {command} exited with status {self.process.returncode} before it answered; its "
            f"output ends: {tail!r} (is openenv-core installed? {INSTALL})"
        )

    def _wait_healthy(self, start_timeout: float) -> bool:
        deadline = time.monotonic() + start_timeout
        while time.monotonic() < deadline and self.process.poll() is None:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=1.0)
            try:
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return True
            except (OSError, http.client.HTTPException):
                pass
            finally:
                conn.close()
            time.sleep(0.1)
        return False

    def _log_tail(self, size: int = 600) -> str:
        self.log.seek(0, 2)
        self.log.seek(max(0, self.log.tell() - size))
        return self.log.read().decode("utf-8", "replace").strip()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_SERVERS: dict[tuple[str, ...], _Server] = {}
_SERVERS_LOCK = threading.Lock()


def local_server(command: list[str], start_timeout: float) -> str:
    """The URL of the server ``command`` runs, starting it on first use (one per process and command)."""
    with _SERVERS_LOCK:
        key = tuple(command)
        server = _SERVERS.get(key)
        if server is None or server.process.poll() is not None:
            server = _SERVERS[key] = _Server(command, start_timeout)
        return server.url


@atexit.register
def stop_servers() -> None:
    """Stop every server this process started."""
    with _SERVERS_LOCK:
        for server in _SERVERS.values():
            server.stop()
        _SERVERS.clear()


class OpenEnvEnvironment:
    """An episode in an OpenEnv environment: ``reset`` opens a session and resets it (the task's ``reset_fields``
    present in the record, e.g. ``seed``, are the reset parameters); the first user message is the reset's
    observation text, or the task's ``src`` when ``prompt_from_task``. ``step`` sends the action ``{action_field:
    reply}`` and returns the observation text (``observation_field`` of the observation, else the whole
    observation as JSON), the reward (null: 0.0) and done; the session closes when done (or at ``close``).

    The server: ``url`` (one already running), or ``app`` (``"package.module:app"``, an ASGI app such as
    ``openenv.core.env_server.create_app(...)`` builds, run with uvicorn on 127.0.0.1) or ``server_command`` (a
    command line whose ``{port}`` is replaced by a free port): started on first use, shared by the process's
    episodes, stopped when the process exits. Episodes running at once need a server that allows as many
    sessions (openenv's ``max_concurrent_envs``); a full server is retried until ``timeout``."""

    def __init__(
        self,
        url: str | None = None,
        app: str | None = None,
        server_command: list[str] | None = None,
        action_field: str = "message",
        observation_field: str | None = None,
        reset_fields: list[str] | tuple[str, ...] = ("seed",),
        prompt_from_task: bool = False,
        timeout: float = 30.0,
        start_timeout: float = 60.0,
        max_message_bytes: int = 2**20,
        max_text_chars: int = 8192,
    ) -> None:
        if sum(x is not None for x in (url, app, server_command)) != 1:
            raise UserError("OpenEnvEnvironment: give exactly one of url, app ('package.module:app') or server_command")
        if app is not None:
            if not isinstance(app, str) or ":" not in app:
                raise UserError(f"OpenEnvEnvironment app {app!r}: must be 'package.module:app' (an ASGI app)")
            server_command = [sys.executable, "-m", "uvicorn", app, "--host", "127.0.0.1", "--port", "{port}"]
            server_command += ["--log-level", "warning"]
        if server_command is not None:
            if not isinstance(server_command, list) or not all(isinstance(p, str) for p in server_command):
                raise UserError(f"OpenEnvEnvironment server_command {server_command!r}: must be a list of strings")
            if not any("{port}" in p for p in server_command):
                raise UserError("OpenEnvEnvironment server_command: must contain {port} (where the server listens)")
            url = local_server(server_command, start_timeout)
        self.url, self.endpoint = url, ws_url(url)
        self.action_field, self.observation_field = action_field, observation_field
        self.reset_fields, self.prompt_from_task = tuple(reset_fields), prompt_from_task
        self.timeout, self.max_message_bytes, self.max_text_chars = timeout, max_message_bytes, max_text_chars
        self.session = None

    def reset(self, task: dict) -> str:
        self.close()
        data = {k: task[k] for k in self.reset_fields if k in task}
        deadline = time.monotonic() + self.timeout
        while True:
            self._connect(deadline)
            try:
                text, _, done = self._call({"type": "reset", "data": data}, deadline)
                break
            except _Full:
                self.close()
                if time.monotonic() + 0.5 > deadline:
                    raise OpenEnvFailure(
                        f"OpenEnv server {self.url} stayed full (all its sessions in use) for {self.timeout:g}s: "
                        "start it with max_concurrent_envs >= the episodes run at once"
                    ) from None
                time.sleep(0.5)
        if done:
            self.close()
            raise OpenEnvFailure(f"OpenEnv server {self.url} answered the reset with done = true: no episode to play")
        if self.prompt_from_task:
            return task_text(task, "src")
        return text

    def step(self, action: str) -> tuple[str | None, float, bool]:
        if self.session is None:
            raise RuntimeError("OpenEnvEnvironment.step without an open episode (reset first)")
        text, reward, done = self._call(
            {"type": "step", "data": {self.action_field: action}}, time.monotonic() + self.timeout
        )
        if done:
            self.close()
            return None, reward, True
        return text, reward, False

    def close(self) -> None:
        """End the session (the server drops its environment); an episode cut short should call it."""
        session, self.session = self.session, None
        if session is not None:
            with contextlib.suppress(Exception):
                session.send(json.dumps({"type": "close"}))
            with contextlib.suppress(Exception):
                session.close()

    def __del__(self) -> None:
        try:  # no module globals here: at interpreter exit they may be gone already
            self.close()
        except Exception:  # noqa: BLE001, S110
            pass

    def _connect(self, deadline: float) -> None:
        try:
            from websockets.sync.client import connect
        except ImportError:
            raise UserError(f"the OpenEnv environment needs the websockets package: {INSTALL}") from None
        host = urllib.parse.urlsplit(self.endpoint).hostname
        try:
            connecting = connect(
                self.endpoint,
                open_timeout=max(deadline - time.monotonic(), 0.1),
                close_timeout=1.0,
                max_size=self.max_message_bytes,
                compression=None,
                proxy=None if host in LOOPBACK else True,
            )
            # entered as a context manager (websockets >= 17.1 deprecates a bare connect()); close() leaves it
            self.session = connecting.__enter__()
        except Exception as err:  # noqa: BLE001 - connection refused, handshake failure, timeout, bad status
            raise OpenEnvFailure(f"cannot open a session at {self.endpoint}: {type(err).__name__}: {err}") from None

    def _call(self, message: dict, deadline: float) -> tuple[str, float, bool]:
        from websockets.exceptions import ConnectionClosed

        try:
            with contextlib.suppress(ConnectionClosed):  # what the server sent before it closed is still read below
                self.session.send(json.dumps(message))
            raw = self.session.recv(timeout=max(deadline - time.monotonic(), 0.0))
        except TimeoutError:
            self.close()
            raise OpenEnvFailure(f"OpenEnv server {self.url} did not answer {message['type']} within {self.timeout:g}s")
        except ConnectionClosed as err:
            self.close()
            code = err.rcvd.code if err.rcvd else err.sent.code if err.sent else None
            if code == 1009:
                raise OpenEnvFailure(
                    f"OpenEnv server {self.url} answered {message['type']} with more than max_message_bytes="
                    f"{self.max_message_bytes} bytes"
                ) from None
            raise OpenEnvFailure(
                f"OpenEnv server {self.url} closed the session during {message['type']}: {err}"
            ) from None
        except OSError as err:
            self.close()
            raise OpenEnvFailure(f"OpenEnv server {self.url}: {message['type']} failed: {err}") from None
        try:
            return self._answer(raw, message["type"])
        except OpenEnvFailure:
            self.close()
            raise

    def _answer(self, raw: str | bytes, kind: str) -> tuple[str, float, bool]:
        where = f"OpenEnv server {self.url} ({kind})"
        try:
            text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
            payload = json.loads(text, parse_constant=_reject_constant)
        except (UnicodeDecodeError, ValueError, RecursionError) as err:
            raise OpenEnvFailure(f"{where} did not answer JSON: {err}") from None
        data = payload.get("data") if isinstance(payload, dict) else None
        if isinstance(payload, dict) and payload.get("type") == "error" and isinstance(data, dict):
            if data.get("code") == "CAPACITY_REACHED" and kind == "reset":
                raise _Full
            raise OpenEnvFailure(f"{where} answered an error: {str(data.get('message'))[:300]} ({data.get('code')})")
        if not isinstance(payload, dict) or payload.get("type") != "observation" or not isinstance(data, dict):
            raise OpenEnvFailure(f'{where} must answer {{"type": "observation", "data": {{...}}}}, got {text[:120]!r}')
        observation, done = data.get("observation"), data.get("done", False)
        if not isinstance(observation, dict):
            raise OpenEnvFailure(f"{where}: the observation must be a JSON object, got {str(observation)[:80]!r}")
        if not isinstance(done, bool):
            raise OpenEnvFailure(f"{where}: done must be true or false, got {done!r:.80}")
        reward = check_reward(data.get("reward"), where)
        if self.observation_field is None:
            message = json.dumps(observation, sort_keys=True, ensure_ascii=False)
        else:
            message = observation.get(self.observation_field)
            if not isinstance(message, str):
                raise OpenEnvFailure(
                    f"{where}: the observation's {self.observation_field!r} must be text, got "
                    f"{type(message).__name__} (observation_field names the field the model reads)"
                )
        if len(message) > self.max_text_chars:
            raise OpenEnvFailure(
                f"{where}: the observation text has {len(message)} characters, more than max_text_chars="
                f"{self.max_text_chars}"
            )
        return message, reward, done


class _Full(Exception):
    """The server has no free session (openenv's CAPACITY_REACHED): the reset is tried again."""
