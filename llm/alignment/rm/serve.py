"""A trained ORM or PRM served over HTTP in the protocol of PPO's ``reward.type: http``.

``POST /`` (or ``/score``) with ``{"prompts": [str], "responses": [str], "references": [str | null],
"ended": [bool]}`` (``references`` and ``ended`` optional; ``ended``: the response stopped at EOS, default
true) answers ``{"scores": [float], "step_scores": [[float], ...]}`` (``step_scores`` for a PRM: p(correct)
of every step). ``GET /health`` answers ``{"status": "ok", "kind": "prm" | "orm", "model": path}``.

The scores are those of PPO's in-process rewards, by the same code (``ORMReward``, ``PRMReward``): the
ORM's score head at the last response token (the texts tokenised with the reward model's tokenizer, EOS
appended to an ended response), the PRM's step scores from the response split at ``step_separator``, read
by the PRM's step scorer (``llm.alignment.rm.scoring``, the interface every PRM kind implements) and
aggregated by ``prm_aggregation``. A request larger than ``max_request_bytes`` is refused (413) before it
is read; one that is not of the form above gets 400 with the reason; a body that ends before its
Content-Length (the client closed its side) gets 400 saying so; a client that sends its body slower than
``request_timeout`` seconds gets 408. Requests are scored one at a time (the model is not thread-safe); the
server itself accepts connections concurrently, ``listen_backlog`` of them waiting to be accepted at once.

The log has one line per request, written once it is answered (the status, and an error's reason); a
client that hangs up (closes or resets the connection) mid-request or mid-answer is one line saying so,
never a traceback, and the server goes on serving.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from llm.settings.registry import PRM_AGGREGATIONS
from llm.utils.errors import UserError

logger = logging.getLogger(__name__)

# PPO's prm_aggregation without "dense" (the server answers one score per response)
AGGREGATIONS = tuple(name for name, fn in PRM_AGGREGATIONS.items() if fn is not None)


@dataclass
class ServeArgument:
    host: str = field(default="127.0.0.1", metadata={"help": "Address to listen on (0.0.0.0: every interface)."})
    port: int = field(default=8000, metadata={"help": "Port to listen on (0: any free port, logged).", "min": 0})
    prm_aggregation: str = field(default="min", metadata={"help": "PRM: min | last | mean of the step scores."})
    step_separator: str = field(default="\n", metadata={"help": "PRM: the text between steps of a response."})
    micro_batch_size: int = field(default=8, metadata={"help": "Samples per forward.", "min": 1})
    max_request_bytes: int = field(
        default=16 * 2**20, metadata={"help": "Largest request body accepted (413 above).", "min": 1}
    )
    request_timeout: float = field(
        default=60.0, metadata={"help": "Seconds a client may take to send its request.", "min": 0}
    )
    listen_backlog: int = field(
        default=128,
        metadata={
            "help": "Connections the kernel holds until the server accepts them (the listen backlog, capped by the "
            "kernel's net.core.somaxconn); with too few, clients connecting at once are refused or reset.",
            "min": 1,
        },
    )

    def __post_init__(self) -> None:
        if self.prm_aggregation not in AGGREGATIONS:
            raise UserError(f"prm_aggregation must be one of {', '.join(AGGREGATIONS)}, got {self.prm_aggregation!r}")


class BadRequest(ValueError):
    pass


class BodyEnded(Exception):
    """The connection's input ended before the body's Content-Length was read."""


def _strings(payload: dict, key: str, n: int | None, optional: bool = False) -> list:
    value = payload.get(key)
    if value is None and optional:
        return [None] * (n or 0)
    if not isinstance(value, list) or (n is not None and len(value) != n):
        raise BadRequest(f"'{key}' must be a list" + (f" of {n} items (one per response)" if n is not None else ""))
    if not all(isinstance(v, str) or (optional and v is None) for v in value):
        raise BadRequest(f"every item of '{key}' must be a string")
    return value


def parse_request(body: bytes) -> tuple[list[str], list[str], list[str | None], list[bool]]:
    try:
        payload = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise BadRequest(f"the body is not UTF-8 JSON ({err})") from None
    except RecursionError:
        raise BadRequest("the body nests too deeply to be a scoring request") from None
    if not isinstance(payload, dict):
        raise BadRequest('the body must be a JSON object {"prompts": [...], "responses": [...]}')
    responses = _strings(payload, "responses", None)
    prompts = _strings(payload, "prompts", len(responses))
    references = _strings(payload, "references", len(responses), optional=True)
    ended = payload.get("ended", [True] * len(responses))
    if not isinstance(ended, list) or len(ended) != len(responses) or not all(isinstance(e, bool) for e in ended):
        raise BadRequest(f"'ended' must be a list of {len(responses)} booleans")
    return prompts, responses, references, ended


class RewardScorer:
    """Scores texts with a reward model the way PPO's in-process reward does."""

    def __init__(self, reward, tokenizer, kind: str, model_path: str, max_tokens: int | None = None) -> None:
        self.reward, self.tokenizer, self.kind, self.model_path = reward, tokenizer, kind, model_path
        self.max_tokens = max_tokens  # the config's max_seq_len: a longer prompt + response is refused (400)
        self.lock = threading.Lock()
        self.stopping = False  # set when the server stops: new requests are refused (503)

    def samples(self, prompts, responses, references, ended):
        from llm.alignment.ppo.interfaces import Samples

        tok = self.tokenizer
        eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
        return Samples(
            [tok(p)["input_ids"] for p in prompts],
            [tok(r, add_special_tokens=False)["input_ids"] + eos * e for r, e in zip(responses, ended)],
            list(prompts),
            list(responses),
            list(references),
            torch.tensor(ended, dtype=torch.bool),
        )

    def score(self, prompts, responses, references, ended) -> dict:
        if not responses:
            return {"scores": []}
        samples = self.samples(prompts, responses, references, ended)
        if self.max_tokens is not None:
            for i, (p, r) in enumerate(zip(samples.prompt_ids, samples.response_ids)):
                if len(p) + len(r) > self.max_tokens:
                    raise BadRequest(
                        f"sample {i} is {len(p) + len(r)} tokens, over max_seq_len={self.max_tokens} of the server's "
                        "config: shorten it (or serve with a larger max_seq_len)"
                    )
        with self.lock:
            logger.debug("scoring %d samples", len(samples.responses))
            if self.kind == "orm":
                return {"scores": self.reward.score(samples).scores.tolist()}
            # the step scorer (llm.alignment.rm.scoring) of the response's steps, as PPO's PRMReward reads them
            steps = self.reward.step_scores(samples)[0]
        aggregate = PRM_AGGREGATIONS[self.reward.aggregation]
        return {"scores": [aggregate(s) for s in steps], "step_scores": steps}


def make_handler(scorer: RewardScorer, args: ServeArgument):
    class Handler(BaseHTTPRequestHandler):
        timeout = args.request_timeout  # each socket operation; the body as a whole: below
        protocol_version = "HTTP/1.1"
        stage = "before its request was read"  # where a hang-up happens, for its log line
        received = 0  # body bytes read

        @property
        def client(self) -> str:
            host, port = self.client_address[:2]
            return f"{host}:{port}"

        def log_message(self, fmt, *a) -> None:  # through logging, not stderr prints
            logger.info("%s %s", self.client, fmt % a)

        def log_request(self, code="-", size="-") -> None:
            """Silent: a request's line is written once it is answered (``_answer``)."""

        def handle(self) -> None:
            try:
                super().handle()
            except ConnectionError as err:  # BrokenPipeError, ConnectionResetError: the client is gone
                self.close_connection = True
                logger.warning("%s: the client hung up %s (%s)", self.client, self.stage, type(err).__name__)

        def _answer(self, status: int, payload: dict) -> None:
            body = json.dumps(payload).encode()
            self.stage = f"before its answer ({status}) was sent"
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            self.stage = "before its next request was read"
            reason = f": {payload['error']}" if "error" in payload else ""
            logger.info('%s "%s" %d%s', self.client, self.requestline, status, reason)

        def do_GET(self) -> None:
            if self.path.rstrip("/") in ("/health", "/healthz"):
                self._answer(200, {"status": "ok", "kind": scorer.kind, "model": scorer.model_path})
            else:
                self._answer(404, {"error": "GET /health; POST / or /score to score"})

        def do_POST(self) -> None:
            if self.path.rstrip("/") not in ("", "/score"):
                return self._answer(404, {"error": "POST / or /score"})
            length = self.headers.get("Content-Length")
            if length is None or not length.isdigit():
                return self._answer(411, {"error": "a Content-Length header is required"})
            if int(length) > args.max_request_bytes:
                self.close_connection = True
                return self._answer(413, {"error": f"the body is over max_request_bytes={args.max_request_bytes}"})
            try:
                body = self._read(int(length))
            except TimeoutError:
                self.close_connection = True
                return self._answer(408, {"error": f"the body took over request_timeout={args.request_timeout:g} s"})
            except BodyEnded:
                self.close_connection = True
                return self._answer(
                    400,
                    {
                        "error": f"the body ended after {self.received} of its {length} bytes (Content-Length): the "
                        "connection's input closed before the rest was sent"
                    },
                )
            if scorer.stopping:
                self.close_connection = True
                return self._answer(503, {"error": "the server is stopping"})
            try:
                request = parse_request(body)
            except BadRequest as err:
                return self._answer(400, {"error": str(err)})
            self.stage = "while its request was scored"
            try:
                scores = scorer.score(*request)
            except BadRequest as err:
                return self._answer(400, {"error": str(err)})
            except Exception as err:  # the client gets the reason, the server keeps serving
                logger.exception("scoring failed")
                return self._answer(500, {"error": f"{type(err).__name__}: {err}"})
            self._answer(200, scores)

        def _read(self, n: int) -> bytes:
            deadline = time.monotonic() + args.request_timeout
            parts, self.received = [], 0
            while self.received < n:
                self.stage = f"while sending its body ({self.received} of {n} bytes read)"
                if time.monotonic() > deadline:
                    raise TimeoutError
                chunk = self.rfile.read1(min(n - self.received, 1 << 16))  # a socket timeout raises TimeoutError
                if not chunk:
                    raise BodyEnded
                parts.append(chunk)
                self.received += len(chunk)
            return b"".join(parts)

    return Handler


class RewardServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        """A client's hang-up outside its handler (closing the connection): one line; anything else: the
        traceback, through logging."""
        err = sys.exc_info()[1]
        if isinstance(err, ConnectionError):
            logger.warning("%s:%s: the client hung up (%s)", *client_address[:2], type(err).__name__)
        else:
            logger.exception("%s:%s: the request failed", *client_address[:2])


def make_server(scorer: RewardScorer, args: ServeArgument) -> RewardServer:
    server = RewardServer((args.host, args.port), make_handler(scorer, args), bind_and_activate=False)
    server.request_queue_size = args.listen_backlog  # the listen backlog (socketserver's default: 5)
    try:
        server.server_bind()
        server.server_activate()
    except OSError as err:
        server.server_close()
        raise UserError(f"cannot listen on {args.host}:{args.port} ({err.strerror}): choose another port") from None
    return server


def build_scorer(model_args, training_args, serve_args: ServeArgument, max_tokens: int | None = None) -> RewardScorer:
    """The reward model of a reward config (``run_reward.py``'s fields) as PPO's ORM / PRM reward; ``max_tokens``:
    the longest prompt + response scored (the config's ``max_seq_len``)."""
    from llm.alignment.ppo.rewards import ORMReward, PRMReward
    from llm.alignment.rm.build import build_reward_model
    from llm.data.encoding import single_token_id
    from llm.utils.modeling import load_tokenizer

    tokenizer = load_tokenizer(model_args.tokenizer_name_or_path or model_args.model_name_or_path)
    if training_args.process_reward and training_args.prm_kind == "implicit":
        return implicit_scorer(model_args, training_args, serve_args, tokenizer, max_tokens)
    model, ids = build_reward_model(model_args, training_args, tokenizer)  # ids: a PRM's reward tokens
    model.eval()
    path = model_args.model_name_or_path
    if not training_args.process_reward:
        orm = ORMReward(model, tokenizer, tokenizer, serve_args.micro_batch_size)
        return RewardScorer(orm, tokenizer, "orm", path, max_tokens)
    if training_args.prm_kind == "generative":  # a critique, then a verdict, per step (llm.alignment.rm.generative)
        from llm.alignment.ppo.rewards.generative import GenerativePRMReward
        from llm.alignment.rm.generative import CritiqueSettings, GenerativePRM

        t = training_args
        settings = CritiqueSettings(
            t.critique_samples, t.max_critique_tokens, t.critique_temperature, t.seed, serve_args.micro_batch_size
        )
        judge = GenerativePRM(model, tokenizer, ids, settings)
        prm = GenerativePRMReward(
            model, tokenizer, tokenizer, serve_args.step_separator, judge, serve_args.prm_aggregation
        )
        return RewardScorer(prm, tokenizer, "prm", path, max_tokens)
    placeholder = model_args.placeholder_token
    prm = PRMReward(
        model,
        tokenizer,
        tokenizer,
        serve_args.step_separator,
        placeholder,
        ids,
        single_token_id(tokenizer, placeholder, "placeholder_token"),
        serve_args.prm_aggregation,
        serve_args.micro_batch_size,
    )
    return RewardScorer(prm, tokenizer, "prm", path, max_tokens)


def implicit_scorer(model_args, training_args, serve_args: ServeArgument, tokenizer, max_tokens) -> RewardScorer:
    """An implicit PRM (``prm_kind: implicit``) as PPO's ``implicit_prm`` reward reads it: the config's
    ``implicit_beta``, the reference ``implicit_reference`` or, unset, the one the model's ``implicit_prm.json``
    names; the answer is the steps' p(correct) and their aggregation, as for a discriminative PRM."""
    from llm.alignment.ppo.rewards.implicit import ImplicitPRMReward
    from llm.alignment.rm.implicit import ImplicitPRM, read_implicit_prm

    path = model_args.model_name_or_path
    reference = model_args.implicit_reference or read_implicit_prm(path, "model_name_or_path")[1]
    scorer = ImplicitPRM.load(
        path, reference, tokenizer, training_args.implicit_beta, serve_args.micro_batch_size, training_args.seed,
        init_from_config=model_args.init_from_config,
    )  # fmt: skip
    reward = ImplicitPRMReward(scorer, tokenizer, serve_args.step_separator, serve_args.prm_aggregation, "token")
    return RewardScorer(reward, tokenizer, "implicit_prm", path, max_tokens)
