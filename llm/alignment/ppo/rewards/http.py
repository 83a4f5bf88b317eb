"""``reward.type: http``: a scoring server reached over HTTP(S) (``llm/serve_reward.py`` serves a trained
ORM / PRM so), with bounded requests, retries and answer checks."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
import urllib.parse
from typing import TYPE_CHECKING

import torch

from llm.alignment.ppo.interfaces import RewardOutput, RoleFailure, Samples
from llm.alignment.ppo.rewards.base import RewardFunction, check_score, register_reward
from llm.settings.shared import check_reward_url

if TYPE_CHECKING:
    from llm.alignment.ppo.context import PPOContext
    from llm.alignment.ppo.loading import Place
    from llm.settings.ppo import PPOConfig


class _Retry(Exception):
    """A reward request that failed in a way worth trying again (connection, timeout, 429, 5xx)."""


@register_reward("http", needs=("url",))
class HttpReward(RewardFunction):
    """POST ``{"prompts", "responses", "references", "ended"}`` as JSON (``ended``: the response stopped at
    EOS); expects ``{"scores": [float, ...]}`` (``llm/serve_reward.py`` serves a trained ORM / PRM so).

    http:// and https:// only; a redirect is an error (never followed: a followed 302 turns the POST into
    a body-less GET). ``timeout`` bounds each request as a whole (connect, send, every byte of the answer),
    not each socket read; a failed request (connection error, timeout, 429, 5xx) is retried up to
    ``max_retries`` times, ``retry_backoff`` seconds before the first retry and twice as long before each
    next one; an answer over ``max_response_bytes`` is an error. A failure stops the run naming the URL."""

    def __init__(
        self,
        url: str,
        timeout: float,
        max_retries: int = 2,
        retry_backoff: float = 1.0,
        max_response_bytes: int = 16 * 2**20,
    ) -> None:
        check_reward_url(url)
        self.url, self.timeout = url, timeout
        self.max_retries, self.retry_backoff, self.max_response_bytes = max_retries, retry_backoff, max_response_bytes
        self.parts = urllib.parse.urlsplit(url)

    @classmethod
    def from_config(cls, c: PPOConfig, place: Place, run: PPOContext) -> HttpReward:
        r = c.reward
        return cls(r.url, r.timeout, r.max_retries, r.retry_backoff, r.max_response_bytes)

    def score(self, samples: Samples) -> RewardOutput:
        body = json.dumps(
            {
                "prompts": samples.prompts,
                "responses": samples.responses,
                "references": samples.references,
                "ended": [bool(e) for e in samples.ended],
            }
        ).encode()
        failures = []
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.retry_backoff * 2 ** (attempt - 1))
            try:
                raw = self._post(body)
                break
            except _Retry as err:
                failures.append(str(err))
        else:
            raise RoleFailure(
                f"reward server {self.url} failed {len(failures)} time(s) (reward.max_retries={self.max_retries}): "
                f"{failures[-1]}; check that it is up, or raise reward.timeout / reward.max_retries"
            )
        return RewardOutput(torch.tensor(self._scores(raw, len(samples))))

    def _scores(self, raw: bytes, n: int) -> list[float]:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise RoleFailure(f"reward server {self.url} answered a body that is not UTF-8 text ({err})") from None
        try:
            payload = json.loads(text)
        except json.JSONDecodeError as err:
            raise RoleFailure(
                f"reward server {self.url} did not answer JSON ({err.msg} at position {err.pos}; the body begins "
                f"{text[:80]!r})"
            ) from None
        scores = payload.get("scores") if isinstance(payload, dict) else None
        if not isinstance(scores, list) or len(scores) != n:
            got = f"{len(scores)} scores" if isinstance(scores, list) else f"{text[:80]!r}"
            raise RoleFailure(
                f'reward server {self.url} must answer {{"scores": [...]}} with {n} numbers (one per sample), got {got}'
            )
        return [check_score(s, f"reward server {self.url} for sample {i}") for i, s in enumerate(scores)]

    def _post(self, body: bytes) -> bytes:
        """One request within ``timeout`` seconds in all: the body of a 2xx answer, ``_Retry`` for a failure
        worth retrying, RoleFailure for one that is not (a redirect, another 4xx, an over-long answer)."""
        p = self.parts
        cls = http.client.HTTPSConnection if p.scheme.lower() == "https" else http.client.HTTPConnection
        conn = cls(p.hostname, p.port, timeout=self.timeout)
        deadline = time.monotonic() + self.timeout
        expired, opened = threading.Event(), []

        def expire() -> None:  # the one deadline: a socket timeout alone bounds each read, not the request
            expired.set()
            for sock in opened:
                with contextlib.suppress(OSError):
                    socket.socket.shutdown(sock, socket.SHUT_RDWR)

        timer = threading.Timer(self.timeout, expire)
        timer.daemon = True
        timer.start()
        path = (p.path or "/") + (f"?{p.query}" if p.query else "")
        try:
            conn.connect()
            opened.append(conn.sock)  # kept: the connection lets go of it once the answer will close it
            if expired.is_set():
                raise TimeoutError
            conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            status = resp.status
            if 300 <= status < 400:
                raise RoleFailure(
                    f"reward server {self.url} answered {status} {resp.reason} redirecting to "
                    f"{resp.getheader('Location')!r}: redirects are not followed (a redirected POST loses its "
                    "body); set reward.url to the final address"
                )
            if status == 429 or status >= 500:
                raise _Retry(f"HTTP {status} {resp.reason}")
            if status >= 400 or status < 200:
                snippet = resp.read1(200).decode("utf-8", "replace") if not expired.is_set() else ""
                raise RoleFailure(f"reward server {self.url} answered HTTP {status} {resp.reason}: {snippet!r}")
            limit = self.max_response_bytes
            length = resp.getheader("Content-Length")
            if length is not None and length.isdigit() and int(length) > limit:
                raise RoleFailure(
                    f"reward server {self.url} answered {int(length)} bytes, more than reward.max_response_bytes="
                    f"{limit}"
                )
            chunks, size = [], 0
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or expired.is_set():
                    raise TimeoutError
                opened[0].settimeout(left)
                chunk = resp.read1(min(65536, limit + 1 - size))
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
                if size > limit:
                    raise RoleFailure(
                        f"reward server {self.url} answered more than reward.max_response_bytes={limit} bytes"
                    )
            if expired.is_set():
                raise TimeoutError
            return b"".join(chunks)
        except (RoleFailure, _Retry):
            raise
        except (OSError, http.client.HTTPException, ValueError) as err:
            if expired.is_set() or isinstance(err, TimeoutError):
                raise _Retry(f"no complete answer in time (timeout {self.timeout:g}s for the whole request)") from None
            raise _Retry(f"{type(err).__name__}: {err}") from None
        finally:
            timer.cancel()
            conn.close()
