"""llm/serve_reward.py: a reward model served in PPO's http reward protocol gives PPO the scores the same model
gives in-process; health, limits and bad requests."""

import http.client
import json
import logging
import os
import socket
import struct
import threading

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from llm.alignment.ppo.rewards import HttpReward
from llm.alignment.rm.serve import ServeArgument, build_scorer, make_server
from llm.run_ppo import main as ppo_main
from llm.settings.load import parse_arguments
from llm.settings.reward import REWARD_ARGUMENT_TYPES
from tests.helpers import ROOT, tiny_model, tokenizer
from tests.test_ppo_run import config as ppo_config
from tests.test_ppo_run import history

TINY_TOKENIZER = os.path.join(ROOT, "llm", "assets", "tiny_tokenizer")


def save_model(path, process_reward: bool):
    kwargs = {} if process_reward else {"auto_class": AutoModelForSequenceClassification, "num_labels": 1}
    model = tiny_model("llama", seed=5, **kwargs)
    model.save_pretrained(path)
    tokenizer().save_pretrained(path)
    return str(path)


def reward_config(tmp_path, model_dir, process_reward: bool) -> str:
    cfg = {
        "model_name_or_path": model_dir,
        "process_reward": process_reward,
        "output_dir": str(tmp_path / "unused"),
        "report_to": "none",
    }
    path = tmp_path / f"serve_{process_reward}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def built(tmp_path, process_reward: bool, **serve):
    """A server as serve_reward.py makes it: listening, not yet serving."""
    model_dir = save_model(tmp_path / f"rm_{process_reward}", process_reward)
    flags = [x for k, v in serve.items() for x in (f"--{k}", str(v))]
    model_args, data_args, training_args, serve_args = parse_arguments(
        [reward_config(tmp_path, model_dir, process_reward), "--port", "0", *flags],
        (*REWARD_ARGUMENT_TYPES, ServeArgument),
    )
    scorer = build_scorer(model_args, training_args, serve_args, data_args.max_seq_len)  # as serve_reward.py
    return make_server(scorer, serve_args), model_dir


@pytest.fixture
def running(tmp_path):
    servers = []

    def start(process_reward: bool, serving: bool = True, **serve):
        server, model_dir = built(tmp_path, process_reward, **serve)
        if serving:
            threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append((server, serving))
        return server, model_dir

    yield start
    for server, serving in servers:
        if serving:
            server.shutdown()
        server.server_close()


def request(server, method, path, body=None, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=30)
    conn.request(method, path, body=body, headers=headers or {})
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read() or b"{}")


def test_ppo_with_the_served_prm_equals_ppo_with_it_in_process(tmp_path, running):
    """Two PPO steps (GRPO, the PRM scores): reward.type http against the server == reward.type prm with the
    same checkpoint in this process: the same scores every step, hence the same run."""
    server, model_dir = running(True, prm_aggregation="min")
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    in_process = {"type": "prm", "model_name_or_path": model_dir, "tokenizer_name_or_path": TINY_TOKENIZER}
    in_process["prm_aggregation"] = "min"
    runs = {}
    for name, reward in (("local", in_process), ("http", {"type": "http", "url": url, "timeout": 60})):
        out = tmp_path / name
        ppo_main(
            [
                ppo_config(
                    tmp_path,
                    reward=reward,
                    training={"output_dir": str(out)},
                    algorithm={"adv_estimator": "grpo"},
                    actor_rollout={"num_samples_per_step": 2},
                )
            ]
        )
        runs[name] = history(out)
    assert len(runs["local"]) == len(runs["http"]) == 2
    for a, b in zip(runs["local"], runs["http"]):
        assert a["score"] == pytest.approx(b["score"], abs=1e-6), (a, b)
        assert a["policy_loss"] == pytest.approx(b["policy_loss"], abs=1e-6)
    assert len({round(h["score"], 6) for h in runs["http"]}) == 2  # the scores are the model's, not constants


def test_served_orm_scores_the_texts_as_the_in_process_orm_does_for_another_tokenizer(running):
    """An ORM over HTTP sees text: it scores the re-tokenised prompt and response (EOS appended when ended),
    exactly what PPO's in-process ORM does when the actor's tokenizer differs from the reward model's. (With
    the same tokenizer the in-process ORM reads the actor's own ids, which equal these where the response
    text round-trips through the tokenizer; random ids need not.)"""
    from llm.alignment.ppo.rewards import ORMReward
    from tests.test_ppo_run import samples

    server, model_dir = running(False)
    s = samples(["7 + 5 = 12\nThe answer is 12.", "it is 8", "no"])
    s.prompts = ["What is 7 + 5?\n"] * 3
    s.ended = torch.tensor([True, False, True])
    served = HttpReward(f"http://127.0.0.1:{server.server_address[1]}/", 30).score(s).scores
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    tok = tokenizer()
    other = tokenizer()
    other.add_tokens(["<a-token-the-reward-model-lacks>"])  # another vocabulary: the text path
    local = ORMReward(model, tok, other, 4).score(s).scores
    torch.testing.assert_close(served, local, rtol=0, atol=1e-6)
    assert len(set(served.tolist())) == 3


def test_health_scores_and_step_scores(running):
    server, model_dir = running(True, prm_aggregation="mean")
    assert request(server, "GET", "/health") == (200, {"status": "ok", "kind": "prm", "model": model_dir})
    body = {"prompts": ["Q?\n", "Q?\n"], "responses": ["a = 1\nb = 2", "c"], "ended": [True, False]}
    status, out = request(server, "POST", "/score", json.dumps(body))
    assert status == 200 and len(out["scores"]) == 2 and [len(s) for s in out["step_scores"]] == [2, 1]
    for score, steps in zip(out["scores"], out["step_scores"]):
        assert score == pytest.approx(sum(steps) / len(steps)) and all(0 < s < 1 for s in steps)
    # the PPO client reads exactly these scores
    from tests.test_ppo_run import samples

    s = samples(["a = 1\nb = 2", "c"])
    s.prompts = ["Q?\n", "Q?\n"]
    s.ended = torch.tensor([True, False])
    got = HttpReward(f"http://127.0.0.1:{server.server_address[1]}/", 30).score(s).scores.tolist()
    assert got == pytest.approx(out["scores"], abs=1e-7)


@pytest.mark.parametrize(
    "body, headers, status, text",
    [
        (b"not json", {}, 400, "not UTF-8 JSON"),
        (json.dumps({"responses": ["a"]}).encode(), {}, 400, "'prompts' must be a list of 1"),
        (json.dumps({"responses": ["a"], "prompts": [3]}).encode(), {}, 400, "must be a string"),
        (json.dumps({"responses": ["a"], "prompts": ["p"], "ended": ["yes"]}).encode(), {}, 400, "booleans"),
        (b"x" * 2000, {}, 413, "max_request_bytes=1000"),
    ],
)
def test_bad_requests_get_a_reason(running, body, headers, status, text):
    server, _ = running(False, max_request_bytes=1000)
    got, out = request(server, "POST", "/", body, {"Content-Type": "application/json", **headers})
    assert got == status and text in out["error"], out
    assert request(server, "GET", "/health")[0] == 200  # still serving


def test_wrong_paths_and_a_missing_length(running):
    server, _ = running(False)
    assert request(server, "GET", "/")[0] == 404
    assert request(server, "POST", "/other", b"{}")[0] == 404
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=10)
    conn.putrequest("POST", "/")
    conn.endheaders()
    assert conn.getresponse().status == 411


def test_serve_argument_checks():
    from llm.utils.errors import UserError

    with pytest.raises(UserError, match="prm_aggregation must be one of min, last, mean"):
        ServeArgument(prm_aggregation="dense")


def test_a_deep_body_and_an_overlong_sample_get_a_400_not_a_dropped_connection(running):
    """A deeply nested JSON body raised RecursionError (a traceback, the connection dropped); a 1 MB prompt was scored
    past the config's max_seq_len, holding the scoring lock for a minute. Both are a 400 naming the problem now, and
    the server goes on serving."""
    server, _ = running(process_reward=False)
    deep = b"[" * 100000 + b"]" * 100000
    status, answer = request(server, "POST", "/", deep, {"Content-Length": str(len(deep))})
    assert status == 400 and "nests too deeply" in answer["error"]
    long = json.dumps({"prompts": ["1 + 1 = " * 2000], "responses": ["2"]}).encode()
    status, answer = request(server, "POST", "/", long, {"Content-Length": str(len(long))})
    assert status == 400 and "over max_seq_len=" in answer["error"], answer
    ok = json.dumps({"prompts": ["1 + 1 ="], "responses": ["2"]}).encode()
    status, answer = request(server, "POST", "/", ok, {"Content-Length": str(len(ok))})
    assert status == 200 and len(answer["scores"]) == 1


def test_sigterm_while_scoring_waits_for_the_request_then_stops(tmp_path):
    """SIGTERM while a request was inside the model's forward aborted the process (rc -6, "terminate called without
    an active exception"): the stop now waits for the request being scored (new ones get 503), then exits 0."""
    import signal
    import subprocess
    import sys
    import time

    model_dir = save_model(tmp_path / "rm", False)
    cfg = reward_config(tmp_path, model_dir, False)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "llm", "serve_reward.py"), cfg, "--port", "0"],
        env=env, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    lines = []
    try:
        for line in proc.stderr:
            lines.append(line)
            if "serving the orm" in line:
                port = int(line.rsplit(":", 1)[1].split()[0])
                break
        big = json.dumps({"prompts": ["1 + 1 ="] * 3000, "responses": ["2"] * 3000}).encode()
        answers = []

        def post():
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            conn.request("POST", "/", body=big, headers={"Content-Length": str(len(big))})
            answers.append(conn.getresponse().status)

        sender = threading.Thread(target=post)
        started = time.monotonic()
        sender.start()
        time.sleep(1.0)  # the 3000 samples are tokenized and in the forward by now
        proc.send_signal(signal.SIGTERM)
        rest = proc.stderr.read()
        proc.wait(timeout=180)
        sender.join(timeout=60)
    finally:
        proc.kill()
    err = "".join(lines) + rest
    assert "terminate called" not in err and proc.returncode == 0, err[-3000:]
    assert answers == [200], (answers, time.monotonic() - started)


# --- many clients, and clients that go away (issue 26, item 6) ----------------------------------------------
SCORE_BODY = json.dumps({"prompts": ["1 + 1 ="], "responses": ["2"]}).encode()


def test_64_clients_connecting_at_once_are_all_answered(running):
    """socketserver's listen backlog is 5: while the server was busy, the 7th client connecting at once waited for
    its SYN to be retried, or was reset (1.1% of requests of 50 clients). All 64 connect here before the server
    accepts any (with a backlog of 5 the 7th connect times out), then each is answered with the same score."""
    server, _ = running(False, serving=False)
    assert server.request_queue_size == 128  # ServeArgument.listen_backlog's default
    port = server.server_address[1]
    conns = []
    for _ in range(64):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.connect()  # completes in the kernel's accept queue: nothing accepts yet
        conns.append(conn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    scores = []
    for conn in conns:
        conn.request("POST", "/", body=SCORE_BODY, headers={"Content-Length": str(len(SCORE_BODY))})
        resp = conn.getresponse()
        assert resp.status == 200
        scores.append(json.loads(resp.read())["scores"])
        conn.close()
    assert len(scores) == 64 and all(s == scores[0] for s in scores) and len(scores[0]) == 1
    server.shutdown()


def raw_post(port: int, declared: int, sent: bytes):
    """A socket that sent a POST's headers declaring ``declared`` body bytes, then ``sent``."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = f"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: {declared}\r\n\r\n".encode()
    sock.sendall(head + sent)
    return sock


def lines_about(caplog, sock_name, wait=30.0):
    """The serve module's log lines naming the client ``sock_name`` (host, port), once there is one."""
    import time

    client = f"{sock_name[0]}:{sock_name[1]}"
    deadline = time.monotonic() + wait
    while True:
        found = [r for r in caplog.records if r.name == "llm.alignment.rm.serve" and client in r.getMessage()]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def test_a_body_cut_short_is_said_to_end_not_to_time_out(running, caplog, capfd):
    """A client that closes its side after 10 of the 100 body bytes it announced: the end of the input used to be
    taken for a timeout (408 "took over request_timeout"); it is a 400 saying the body ended, in one log line."""
    caplog.set_level(logging.INFO, logger="llm.alignment.rm.serve")
    server, _ = running(False)
    sock = raw_post(server.server_address[1], 100, b'{"prompts":')  # 11 bytes
    name = sock.getsockname()
    sock.shutdown(socket.SHUT_WR)  # end of input; the answer can still be read
    answer = b""
    while chunk := sock.recv(65536):
        answer += chunk
    sock.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), answer
    assert "the body ended after 11 of its 100 bytes" in json.loads(body)["error"]
    found = lines_about(caplog, name)
    assert len(found) == 1 and "400: the body ended after 11 of its 100 bytes" in found[0].getMessage()
    assert request(server, "GET", "/health")[0] == 200
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.parametrize("where", ["while sending its body", "before its answer (200) was sent"])
def test_a_client_hanging_up_is_one_log_line_and_the_server_serves_on(running, caplog, capfd, monkeypatch, where):
    """A client that resets the connection while sending its body, or after sending its request and before reading
    the answer, left a ConnectionResetError / BrokenPipeError traceback in the server's log; now one line."""
    from llm.alignment.rm import serve

    caplog.set_level(logging.INFO, logger="llm.alignment.rm.serve")
    scoring, hung_up = threading.Event(), threading.Event()
    score = serve.RewardScorer.score

    def held_score(self, *request):  # the answer waits until the client has gone
        scoring.set()
        assert hung_up.wait(30)
        return score(self, *request)

    monkeypatch.setattr(serve.RewardScorer, "score", held_score)
    server, _ = running(False)
    if where == "while sending its body":
        reading = threading.Event()
        read = server.RequestHandlerClass._read

        def watched_read(self, n):
            reading.set()
            return read(self, n)

        monkeypatch.setattr(server.RequestHandlerClass, "_read", watched_read)
        sock = raw_post(server.server_address[1], 100, b'{"prompts"')
        assert reading.wait(30)  # the headers (and the 10 body bytes sent with them) arrived
    else:
        sock = raw_post(server.server_address[1], len(SCORE_BODY), SCORE_BODY)
        assert scoring.wait(30)  # the whole body was read
    name = sock.getsockname()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()  # with linger 0: a reset, not an orderly close
    hung_up.set()
    found = lines_about(caplog, name)
    assert len(found) == 1 and f"the client hung up {where}" in found[0].getMessage(), [r.getMessage() for r in found]
    assert found[0].exc_info is None
    assert request(server, "GET", "/health")[0] == 200  # still serving
    err = capfd.readouterr().err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err[-3000:]


def test_listen_backlog_is_a_checked_setting(tmp_path):
    from llm.utils.errors import UserError

    assert ServeArgument(listen_backlog=512).listen_backlog == 512
    with pytest.raises(UserError, match="listen_backlog"):
        parse_arguments(
            [reward_config(tmp_path, TINY_TOKENIZER, False), "--listen_backlog", "0"],
            (*REWARD_ARGUMENT_TYPES, ServeArgument),
        )
