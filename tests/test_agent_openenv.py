"""The OpenEnv adapter against a real local OpenEnv server (tests/openenv_counter.py, built from openenv-core's own
classes and started by the adapter), and its checks of an untrusted server's answers (a scripted WebSocket
server). No network: everything listens on 127.0.0.1."""

from __future__ import annotations

import json
import sys
import threading
import time

import pytest
from websockets.sync.server import serve

from llm.alignment.ppo.agent.adapters import openenv
from llm.alignment.ppo.agent.adapters.openenv import OpenEnvEnvironment, OpenEnvFailure, ws_url
from llm.utils.errors import UserError
from tests.helpers import ROOT

APP = "tests.openenv_counter:app"


@pytest.fixture(scope="module")
def counter_server():
    """The counter server, started once by the adapter (uvicorn in a child process) and stopped at the end."""
    mp = pytest.MonkeyPatch()
    mp.chdir(ROOT)  # uvicorn imports tests.openenv_counter from the working directory
    try:
        OpenEnvEnvironment(app=APP)  # starts the server
        yield
    finally:
        openenv.stop_servers()
        mp.undo()


def test_round_trip_with_a_real_openenv_server(counter_server):
    """A stateful episode over one session: the reset's seed sets the episode length (seed 6: 6 % 5 + 1 = 2
    steps), feedback is the observation's text, the reward comes at the end; two episodes at once do not mix."""
    env = OpenEnvEnvironment(app=APP, observation_field="text")
    other = OpenEnvEnvironment(app=APP, observation_field="text")
    assert env.reset({"src": "count", "seed": 6}) == "count to 2"
    assert other.reset({"src": "count"}) == "count to 3"  # no seed: 3 steps
    assert env.step("a") == ("a #1", 0.0, False)
    assert other.step("x") == ("x #1", 0.0, False)
    assert env.step("b") == (None, 2.0, True)  # done: the reward is the step count
    assert env.session is None  # the session was closed with the episode
    with pytest.raises(RuntimeError, match="reset first"):
        env.step("c")
    assert other.step("y") == ("y #2", 0.0, False)
    assert other.step("z") == (None, 3.0, True)
    # the next episode starts over; the task's src instead of the server's reset text; the whole observation as JSON
    env = OpenEnvEnvironment(app=APP, prompt_from_task=True)
    assert env.reset({"src": "Count with me.", "seed": 5}) == "Count with me."
    assert env.step("go") == (None, 1.0, True)  # seed 5: one step
    env = OpenEnvEnvironment(app=APP)
    env.reset({"seed": 6})
    message, reward, done = env.step("a")
    assert json.loads(message) == {"count": 1, "text": "a #1"} and (reward, done) == (0.0, False)
    env.close()


def test_a_real_server_answer_over_the_limits_is_refused(counter_server):
    env = OpenEnvEnvironment(app=APP, observation_field="text", max_message_bytes=100_000)
    env.reset({"seed": 6})
    with pytest.raises(OpenEnvFailure, match="max_message_bytes=100000"):
        env.step("huge")  # a 3 MB observation
    assert env.session is None
    env = OpenEnvEnvironment(app=APP, observation_field="count")
    with pytest.raises(OpenEnvFailure, match="'count' must be text, got int"):
        env.reset({"seed": 6})
    env = OpenEnvEnvironment(app=APP, observation_field="text", max_text_chars=5)
    with pytest.raises(OpenEnvFailure, match="max_text_chars=5"):
        env.reset({"seed": 6})  # "count to 2": 10 characters


def test_a_server_that_does_not_start_is_one_clear_error():
    command = [sys.executable, "-c", "import sys; print('no such env'); sys.exit(3)", "{port}"]
    with pytest.raises(OpenEnvFailure, match="exited with status 3.*no such env"):
        OpenEnvEnvironment(server_command=command)
    with pytest.raises(UserError, match="exactly one of"):
        OpenEnvEnvironment(url="http://127.0.0.1:1", app=APP)
    with pytest.raises(UserError, match=r"\{port\}"):
        OpenEnvEnvironment(server_command=[sys.executable, "-m", "uvicorn", APP])
    with pytest.raises(UserError, match="http://host:port"):
        ws_url("ftp://127.0.0.1:8000")
    assert ws_url("http://127.0.0.1:8000/") == "ws://127.0.0.1:8000/ws"
    assert ws_url("https://example.org/env") == "wss://example.org/env/ws"


GOOD_RESET = '{"type": "observation", "data": {"observation": {"text": "ready"}, "reward": null, "done": false}}'
BAD_ANSWERS = {
    "not json": ("this is not JSON", "did not answer JSON"),
    "nan": ('{"type": "observation", "data": {"observation": {"text": "t"}, "reward": NaN, "done": false}}', "NaN"),
    "inf": ('{"type": "observation", "data": {"observation": {"text": "t"}, "reward": 1e39, "done": true}}', "float32"),
    "str reward": (
        '{"type": "observation", "data": {"observation": {"text": "t"}, "reward": "1", "done": true}}',
        "reward",
    ),
    "str done": (
        '{"type": "observation", "data": {"observation": {"text": "t"}, "reward": 1, "done": "yes"}}',
        "done must",
    ),
    "list obs": ('{"type": "observation", "data": {"observation": ["t"], "reward": 1, "done": true}}', "JSON object"),
    "no text": (
        '{"type": "observation", "data": {"observation": {"txt": "t"}, "reward": 0, "done": false}}',
        "'text' must",
    ),
    "wrong type": ('{"type": "state", "data": {}}', "must answer"),
    "error": ('{"type": "error", "data": {"message": "boom", "code": "EXECUTION_ERROR"}}', "boom"),
    "silence": (None, "did not answer step within 0.5s"),
}


@pytest.fixture(scope="module")
def scripted_server():
    """A WebSocket server speaking OpenEnv's protocol badly on purpose: a step's action text picks the answer
    (BAD_ANSWERS); a reset with "full" answers "no free session" to the first connection."""
    full_once = []

    def handle(ws):
        for raw in ws:
            message = json.loads(raw)
            if message["type"] == "close":
                return
            if message["type"] == "reset":
                if message["data"].get("full") and not full_once:
                    full_once.append(1)
                    ws.send('{"type": "error", "data": {"message": "full", "code": "CAPACITY_REACHED"}}')
                    return
                ws.send(GOOD_RESET)
                continue
            answer = BAD_ANSWERS[message["data"]["message"]][0]
            if answer is None:
                time.sleep(1.0)
                return
            ws.send(answer)

    with serve(handle, "127.0.0.1", 0) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        yield f"http://127.0.0.1:{server.socket.getsockname()[1]}"
        server.shutdown()


@pytest.mark.parametrize("action", sorted(BAD_ANSWERS))
def test_a_bad_answer_is_refused(scripted_server, action):
    env = OpenEnvEnvironment(url=scripted_server, observation_field="text", timeout=0.5)
    assert env.reset({"src": "q"}) == "ready"
    with pytest.raises(OpenEnvFailure, match=BAD_ANSWERS[action][1]) as err:
        env.step(action)
    assert scripted_server in str(err.value) and env.session is None


def test_a_full_server_is_tried_again(scripted_server):
    env = OpenEnvEnvironment(url=scripted_server, observation_field="text", reset_fields=["full"], timeout=5)
    assert env.reset({"src": "q", "full": True}) == "ready"  # the first connection was refused
    env.close()
    with pytest.raises(OpenEnvFailure, match="cannot open a session"):
        OpenEnvEnvironment(url="http://127.0.0.1:9", timeout=0.5).reset({"src": "q"})  # nothing listens there
