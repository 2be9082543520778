"""Merge concurrent scoring requests into model batches.

Each request waits on a future in an asyncio queue. One batcher task takes the first waiting request,
then keeps taking more until the merged batch holds `max_batch_size` items or `max_wait_ms` passed since
the first one arrived, runs the source's `score()` once in a worker thread (the event loop keeps
accepting requests meanwhile) and hands each caller its slice of the scores.

A request is never split: one larger than `max_batch_size` is scored alone (the source cuts it into its
own forward passes). When a merged batch fails, each of its requests is scored again on its own, so a
request that makes the source fail gets the error and the others still get their scores.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import Optional

from engines.rewards.base import RewardBatch, RewardError, RewardSource


@dataclass
class ServedBatch(RewardBatch):
    """A RewardBatch whose `queries` are the client's texts verbatim (OpenRLHF sends prompt + response as
    one string that may not split exactly into the prompt it also sends)."""

    query_texts: list[str] = field(default_factory=list)

    @property
    def queries(self) -> list[str]:
        return list(self.query_texts)


def merge_batches(batches: list[ServedBatch]) -> ServedBatch:
    """Concatenate the batches' rows in order."""
    merged = ServedBatch([], [], [], [], [], [], [], [])
    for b in batches:
        for name in (
            "prompts",
            "responses",
            "prompt_ids",
            "response_ids",
            "labels",
            "data_sources",
            "sample_ids",
            "query_texts",
        ):
            getattr(merged, name).extend(getattr(b, name))
    return merged


@dataclass
class BatcherStats:
    requests: int = 0  # requests answered with scores or an error
    items: int = 0  # rows scored successfully
    model_batches: int = 0  # calls to source.score()
    failed_batches: int = 0  # calls to source.score() that raised or returned a bad answer


@dataclass
class _Pending:
    batch: ServedBatch
    future: asyncio.Future


class RequestBatcher:
    """Collects requests for up to `max_wait_ms` or `max_batch_size` items, scores them together."""

    def __init__(self, source: RewardSource, max_batch_size: int = 64, max_wait_ms: float = 10.0):
        if max_batch_size < 1 or max_wait_ms < 0:
            raise ValueError(f"max_batch_size must be >= 1 and max_wait_ms >= 0, got {max_batch_size}, {max_wait_ms}")
        self.source = source
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_ms / 1000.0
        self.stats = BatcherStats()
        self._queue: Optional[asyncio.Queue] = None
        self._task: Optional[asyncio.Task] = None
        self._carry: Optional[_Pending] = None  # a request that did not fit the previous batch

    def start(self) -> None:
        """Start the batcher task on the running event loop (idempotent)."""
        if self._task is None or self._task.done():
            self._queue = asyncio.Queue()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="reward-batcher")

    async def stop(self) -> None:
        """Cancel the batcher task and fail the requests still waiting."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        waiting = [self._carry] if self._carry else []
        while self._queue is not None and not self._queue.empty():
            waiting.append(self._queue.get_nowait())
        for pending in waiting:
            if not pending.future.done():
                pending.future.set_exception(RuntimeError("reward server is shutting down"))
        self._task, self._carry = None, None

    async def submit(self, batch: ServedBatch) -> list[float]:
        """Queue one request; returns its scores in order or raises the source's error."""
        self.start()
        future = asyncio.get_running_loop().create_future()
        await self._queue.put(_Pending(batch, future))
        return await future

    async def _collect(self) -> list[_Pending]:
        first = self._carry or await self._queue.get()
        self._carry = None
        group, size = [first], len(first.batch)
        deadline = asyncio.get_running_loop().time() + self.max_wait_s
        while size < self.max_batch_size:
            remaining = deadline - asyncio.get_running_loop().time()
            try:
                nxt = (
                    self._queue.get_nowait() if remaining <= 0 else await asyncio.wait_for(self._queue.get(), remaining)
                )
            except (asyncio.QueueEmpty, asyncio.TimeoutError):
                break
            if size + len(nxt.batch) > self.max_batch_size:
                self._carry = nxt
                break
            group.append(nxt)
            size += len(nxt.batch)
        return group

    async def _run(self) -> None:
        while True:
            group = await self._collect()
            live = [p for p in group if not p.future.done()]  # a caller may have gone away
            if live:
                await self._score_group(live)

    def _score_checked(self, batch: ServedBatch) -> list[float]:
        """source.score() with its answer checked: B finite floats. Runs in a worker thread."""
        scores = self.source.score(batch)
        if len(scores) != len(batch):
            raise RewardError(f"reward source {self.source.name!r} returned {len(scores)} scores for {len(batch)} rows")
        out = []
        for i, s in enumerate(scores):
            if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s):
                raise RewardError(f"reward source {self.source.name!r} returned {s!r} for {batch.sample_ids[i]}")
            out.append(float(s))
        return out

    async def _score_one_call(self, batch: ServedBatch) -> list[float]:
        self.stats.model_batches += 1
        try:
            return await asyncio.to_thread(self._score_checked, batch)
        except Exception:
            self.stats.failed_batches += 1
            raise

    async def _score_group(self, group: list[_Pending]) -> None:
        try:
            scores = await self._score_one_call(merge_batches([p.batch for p in group]))
        except Exception as err:  # noqa: BLE001 - handed to the callers, never swallowed
            if len(group) == 1:
                self._answer(group[0], error=err)
                return
            for pending in group:  # find which request fails; the others still get scores
                try:
                    self._answer(pending, scores=await self._score_one_call(pending.batch))
                except Exception as one_err:  # noqa: BLE001
                    self._answer(pending, error=one_err)
            return
        start = 0
        for pending in group:
            end = start + len(pending.batch)
            self._answer(pending, scores=scores[start:end])
            start = end

    def _answer(
        self, pending: _Pending, scores: Optional[list[float]] = None, error: Optional[BaseException] = None
    ) -> None:
        self.stats.requests += 1
        if pending.future.done():
            return
        if error is not None:
            pending.future.set_exception(error)
        else:
            self.stats.items += len(scores)
            pending.future.set_result(scores)
