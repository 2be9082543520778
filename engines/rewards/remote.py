"""A reward source behind HTTP: ppoflow's own `serve-reward` server or an OpenRLHF-style reward server.

Request (OpenRLHF's shape), one per chunk of `batch_size` rows:
    POST <url>  {"query": [prompt + response, ...], "prompts": [...], "labels": [...]}
    -> {"rewards": [float, ...]}
`url` is the endpoint itself (http://host:5000/get_reward, as OpenRLHF's --remote_rm_url) or a bare
server address (http://127.0.0.1:8000), which means ppoflow's `/score`.

Failures: 5xx answers, timeouts and connection errors are retried `max_retries` times with exponential
backoff (backoff_s, 2 * backoff_s, ...); a 4xx answer (401 wrong token, 413 too large, 422 bad shape)
fails at once, since repeating it cannot help; so does an answer that is not JSON, has the wrong length
or holds a non-numeric or non-finite reward. Every failure is a RewardError naming the server, the status
and the samples.

identity: the endpoint URL plus the server's /health "identity" (ppoflow's server reports its source's),
read once per source object, so a server that now serves another model is a new identity. A server with
no /health (OpenRLHF's) gives the URL alone: change the URL or the source name when its model changes.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any, Optional

import httpx

from engines.rewards.base import RewardBatch, RewardError

_BODY_EXCERPT = 300


def _endpoint_and_health(url: str) -> tuple[str, str]:
    parsed = httpx.URL(url)
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise RewardError(f"remote reward source: {url!r} is not an http(s) URL")
    base = f"{parsed.scheme}://{parsed.netloc.decode()}"
    endpoint = f"{base}/score" if parsed.path in ("", "/") else str(parsed)
    return endpoint, f"{base}/health"


class RemoteRewardSource:
    """Scores batches by POSTing them to a reward server; see the module docstring for the protocol.

    token: bearer token (None sends no Authorization header). timeout_s: per HTTP call.
    Counters: `http_calls` (attempts made) and `retries` (attempts after a retryable failure).
    """

    reward_inputs = ("label",)  # the request carries the labels, not the data_source

    def __init__(
        self,
        url: str,
        *,
        name: str = "remote",
        token: Optional[str] = None,
        timeout_s: float = 60.0,
        batch_size: int = 64,
        max_retries: int = 3,
        backoff_s: float = 0.5,
    ):
        if batch_size < 1 or max_retries < 0 or timeout_s <= 0:
            raise RewardError(
                f"remote reward source {name!r}: batch_size >= 1, max_retries >= 0 and "
                f"timeout_s > 0 needed, got {batch_size}, {max_retries}, {timeout_s}"
            )
        self.url = url
        self.endpoint, self.health_url = _endpoint_and_health(url)
        self.name, self.batch_size, self.max_retries, self.backoff_s = name, batch_size, max_retries, backoff_s
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = httpx.Client(headers=headers, timeout=timeout_s)
        self._identity: Optional[str] = None
        self.http_calls = 0
        self.retries = 0

    def close(self) -> None:
        self._client.close()

    @property
    def identity(self) -> str:
        if self._identity is None:
            answer = self._request("GET", self.health_url, None, "health check", allow_missing=True)
            server_identity = answer.get("identity") if isinstance(answer, dict) else None
            suffix = f"|{server_identity}" if server_identity else ""
            self._identity = f"{type(self).__name__}|{self.endpoint}{suffix}"
        return self._identity

    def _request(self, method: str, url: str, payload: Any, what: str, allow_missing: bool = False) -> Any:
        """One call with retries on 5xx/timeouts/connection errors; returns the decoded JSON answer.

        allow_missing: a 404/405 answers None (a server without that endpoint) instead of an error.
        """
        content = None
        if payload is not None:
            try:
                content = json.dumps(payload).encode()
            except (TypeError, ValueError) as err:
                raise RewardError(f"reward server {self.endpoint}: {what} cannot be sent as JSON: {err}") from None
        last_problem = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                self.retries += 1
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            self.http_calls += 1
            try:
                resp = self._client.request(
                    method, url, content=content, headers={"Content-Type": "application/json"} if content else None
                )
            except (httpx.TimeoutException, httpx.TransportError) as err:
                last_problem = f"{type(err).__name__}: {err}"
                continue
            if resp.status_code >= 500:
                last_problem = f"HTTP {resp.status_code}: {resp.text[:_BODY_EXCERPT]}"
                continue
            if allow_missing and resp.status_code in (404, 405):
                return None
            if resp.status_code >= 400:
                raise RewardError(
                    f"reward server {url} answered HTTP {resp.status_code} to the {what}: {resp.text[:_BODY_EXCERPT]}"
                )
            try:
                return resp.json()
            except ValueError:
                raise RewardError(
                    f"reward server {url} answered the {what} with something that is not JSON: "
                    f"{resp.text[:_BODY_EXCERPT]!r}"
                ) from None
        raise RewardError(
            f"reward server {url} failed the {what} after {self.max_retries + 1} attempts; last: {last_problem}"
        )

    def _check_rewards(self, answer: Any, names: list[str]) -> list[float]:
        """The answer's rewards as floats; RewardError naming the sample for a malformed one."""
        rewards = answer.get("rewards") if isinstance(answer, dict) else None
        if not isinstance(rewards, list):
            raise RewardError(
                f"reward server {self.endpoint} answered without a 'rewards' list for "
                f"{names[0]}..{names[-1]}: {str(answer)[:_BODY_EXCERPT]}"
            )
        if len(rewards) != len(names):
            raise RewardError(
                f"reward server {self.endpoint} returned {len(rewards)} rewards for "
                f"{len(names)} samples ({names[0]}..{names[-1]})"
            )
        out = []
        for name, value in zip(names, rewards):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise RewardError(
                    f"reward server {self.endpoint} returned {value!r} for {name}; expected a finite number"
                )
            out.append(float(value))
        return out

    def score(self, batch: RewardBatch) -> list[float]:
        """B floats in order, one POST per `batch_size` rows. Raises RewardError (see module docstring)."""
        n = len(batch)
        queries = batch.queries
        labels = batch.labels if len(batch.labels) == n else [None] * n
        names = [batch.sample_ids[i] if i < len(batch.sample_ids) else f"sample {i}" for i in range(n)]
        scores: list[float] = []
        for start in range(0, n, self.batch_size):
            end = min(start + self.batch_size, n)
            payload = {"query": queries[start:end], "prompts": batch.prompts[start:end], "labels": labels[start:end]}
            answer = self._request("POST", self.endpoint, payload, f"request for {names[start]}..{names[end - 1]}")
            scores.extend(self._check_rewards(answer, names[start:end]))
        return scores
