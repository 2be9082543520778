"""The reward server's HTTP surface (FastAPI), around any RewardSource.

    POST /score, POST /get_reward   (auth)  {"query": [...], "prompts": [...], "labels": [...]}
                                            -> {"rewards": [...], "scores": [...]}
    GET  /stats                     (auth)  batcher counters
    GET  /health                            {"status": "ok", "source": name, "identity": ...}

The request shape is OpenRLHF's remote reward model request (`query` = prompt + response text, one per
sample; `prompts` and `labels` optional), and /get_reward is its path, so OpenRLHF clients can use this
server and RemoteRewardSource can use theirs. "scores" repeats "rewards" for newer OpenRLHF clients.

Status codes: 401 missing or wrong bearer token (compared in constant time); 413 body over
`max_body_bytes` or more than `max_request_items` queries; 422 body that is not JSON or not that shape;
500 the source failed (the detail carries its message, the client fails its stage). A bad request never
stops the server.

/health needs no token so that probes work; it reports the source's identity so that a client's score
cache notices when the model behind a URL changes.
"""

from __future__ import annotations

import hmac
import json
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Optional

from fastapi import Depends, FastAPI, HTTPException, Request
from pydantic import BaseModel, ConfigDict, ValidationError

from engines.reward_server.batcher import RequestBatcher, ServedBatch
from engines.rewards.base import RewardSource

DEFAULT_MAX_BODY_BYTES = 32 * 2**20


@dataclass(frozen=True)
class ServerLimits:
    """What one server accepts and how it batches: the keywords of `build_app` and `serve` after the token.

    max_batch_size: items per call of the source (requests are merged up to it); max_wait_ms: how long a
    batch waits for more requests; max_request_items: queries in one request (413 above);
    max_body_bytes: a request body's size (413 above). ValueError for a limit below 1 or a negative wait.
    """

    max_batch_size: int = 64
    max_wait_ms: float = 10.0
    max_request_items: int = 1024
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES

    def __post_init__(self):
        if self.max_request_items < 1 or self.max_body_bytes < 1:
            got = f"{self.max_request_items}, {self.max_body_bytes}"
            raise ValueError(f"max_request_items and max_body_bytes must be >= 1, got {got}")


class ScoreRequest(BaseModel):
    """OpenRLHF's request. Unknown keys are ignored so that newer clients' extra fields do not break it."""

    model_config = ConfigDict(extra="ignore")
    query: list[str]
    prompts: Optional[list[str]] = None
    labels: Optional[list[Any]] = None


def _split_response(query: str, prompt: str) -> str:
    """The response part of a query: what follows the prompt, or the whole query when the prompt is absent."""
    at = query.find(prompt) if prompt else -1
    return query[at + len(prompt) :] if at >= 0 else query


def to_served_batch(req: ScoreRequest, request_id: int) -> ServedBatch:
    """Build the RewardBatch a source scores; 422 when prompts/labels do not match the queries' count."""
    n = len(req.query)
    for field_name in ("prompts", "labels"):
        value = getattr(req, field_name)
        if value is not None and len(value) != n:
            raise HTTPException(422, f"{field_name} has {len(value)} items but query has {n}")
    prompts = req.prompts if req.prompts is not None else [""] * n
    return ServedBatch(
        prompts=list(prompts),
        responses=[_split_response(q, p) for q, p in zip(req.query, prompts)],
        prompt_ids=[[] for _ in range(n)],
        response_ids=[[] for _ in range(n)],
        labels=list(req.labels) if req.labels is not None else [None] * n,
        data_sources=[None] * n,
        sample_ids=[f"request {request_id} item {i}" for i in range(n)],
        query_texts=list(req.query),
    )


def _bearer_check(token: str):
    expected = token.encode()

    def check(request: Request) -> None:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected):
            raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    return check


async def _read_body(request: Request, max_body_bytes: int) -> bytes:
    """The body, or 413 as soon as it passes max_body_bytes (declared or streamed)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
        raise HTTPException(413, f"body of {declared} bytes is over the limit of {max_body_bytes}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body_bytes:
            raise HTTPException(413, f"body is over the limit of {max_body_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _parse_request(body: bytes, max_request_items: int) -> ScoreRequest:
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise HTTPException(422, f"body is not JSON: {err}") from None
    try:
        req = ScoreRequest.model_validate(data)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '<body>'}: {e['msg']}" for e in err.errors()[:5])
        raise HTTPException(
            422, f"expected {{'query': [str], 'prompts': [str], 'labels': [...]}}: {problems}"
        ) from None
    if len(req.query) > max_request_items:
        raise HTTPException(413, f"{len(req.query)} queries in one request; the limit is {max_request_items}")
    return req


def build_app(source: RewardSource, token: str, **limits) -> FastAPI:
    """The FastAPI app serving `source`; `limits`: ServerLimits' fields. Raises ValueError for an empty token
    or non-positive limits, TypeError for a keyword that is not a limit."""
    if not token:
        raise ValueError("the reward server needs a non-empty bearer token")
    limit = ServerLimits(**limits)
    batcher = RequestBatcher(source, max_batch_size=limit.max_batch_size, max_wait_ms=limit.max_wait_ms)
    counters = {"next_request_id": 0, "rejected": 0}

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        batcher.start()
        yield
        await batcher.stop()

    app = FastAPI(title="ppoflow reward server", lifespan=lifespan)
    app.state.batcher = batcher
    authorized = Depends(_bearer_check(token))

    async def score(request: Request) -> dict:
        try:
            req = _parse_request(await _read_body(request, limit.max_body_bytes), limit.max_request_items)
            counters["next_request_id"] += 1
            batch = to_served_batch(req, counters["next_request_id"])
        except HTTPException:
            counters["rejected"] += 1
            raise
        if len(batch) == 0:
            return {"rewards": [], "scores": []}
        try:
            rewards = await batcher.submit(batch)
        except Exception as err:  # noqa: BLE001 - the client must see the source's failure
            raise HTTPException(500, f"reward source {source.name!r} failed: {err}") from None
        return {"rewards": rewards, "scores": rewards}

    app.add_api_route("/score", score, methods=["POST"], dependencies=[authorized])
    app.add_api_route("/get_reward", score, methods=["POST"], dependencies=[authorized])

    @app.get("/stats", dependencies=[authorized])
    async def stats() -> dict:
        s = batcher.stats
        return {
            "requests": s.requests,
            "items": s.items,
            "model_batches": s.model_batches,
            "failed_batches": s.failed_batches,
            "rejected": counters["rejected"],
        }

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "source": source.name, "identity": getattr(source, "identity", None)}

    return app
