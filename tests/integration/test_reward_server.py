"""The reward server on loopback (uvicorn in a thread) and RemoteRewardSource against it."""

import asyncio
import threading
import time

import httpx
import pytest

from engines.reward_server import build_app, serve_in_thread
from engines.rewards.base import RewardBatch, RewardError
from engines.rewards.remote import RemoteRewardSource
from engines.toy.task import digit_reward

pytestmark = pytest.mark.slow
TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class DigitsSource:
    """The digits reward as a batched source. Each call sleeps 20 ms, as a model would, so concurrent
    requests pile up while a batch runs. A label "boom" makes the call fail naming the sample."""

    name = "digits"
    identity = "digits-v1"

    def __init__(self, fail_first_calls: int = 0):
        self.calls = 0
        self.fail_first_calls = fail_first_calls
        self._lock = threading.Lock()

    def score(self, batch: RewardBatch) -> list[float]:
        with self._lock:
            self.calls += 1
            if self.calls <= self.fail_first_calls:
                raise RuntimeError("warming up")
        time.sleep(0.02)
        for sample, label in zip(batch.sample_ids, batch.labels):
            if label == "boom":
                raise RewardError(f"cannot score {sample}")
        return [digit_reward(r, label) for r, label in zip(batch.responses, batch.labels)]


def digits_request(i: int) -> tuple[dict, list[float]]:
    """Client i asks for 2 rows: digit d = i % 10 repeated k = i % 9 times, then j = i % 3 other words.
    By the task's definition the reward is k / max(k + j, 8) (hits over max(words, 8)); the second row
    has no hits (reward 0) because it repeats another digit."""
    d, k, j = i % 10, i % 9, i % 3
    other = str((d + 1) % 10)
    prompt = f"repeat {d} :"
    words = [str(d)] * k + ["now"] * j
    query = [prompt + " " + " ".join(words), prompt + " " + " ".join([other] * 4)]
    return {"query": query, "prompts": [prompt, prompt], "labels": [str(d), str(d)]}, [k / max(k + j, 8), 0.0]


@pytest.fixture(scope="module")
def digits_server():
    source = DigitsSource()
    app = build_app(source, TOKEN, max_batch_size=64, max_wait_ms=20, max_request_items=16, max_body_bytes=64 * 1024)
    with serve_in_thread(app) as url:
        yield url, source


def stats(url: str) -> dict:
    return httpx.get(f"{url}/stats", headers=AUTH, timeout=5).json()


class TestConcurrency:
    def test_64_concurrent_clients_get_their_rewards_in_fewer_batches(self, digits_server):
        url, _ = digits_server
        before = stats(url)

        async def client(http: httpx.AsyncClient, i: int):
            body, expected = digits_request(i)
            resp = await http.post(f"{url}/score", json=body, headers=AUTH)
            return resp.status_code, resp.json()["rewards"], expected

        async def main():
            limits = httpx.Limits(max_connections=64)
            async with httpx.AsyncClient(timeout=10, limits=limits) as http:
                return await asyncio.wait_for(asyncio.gather(*(client(http, i) for i in range(64))), 60)

        for status, rewards, expected in asyncio.run(main()):
            assert status == 200
            assert rewards == pytest.approx(expected, abs=1e-12)
        after = stats(url)
        assert after["requests"] - before["requests"] == 64
        assert after["items"] - before["items"] == 128
        assert after["model_batches"] - before["model_batches"] < 64

    def test_openrlhf_path_answers_the_same(self, digits_server):
        url, _ = digits_server
        body, expected = digits_request(7)
        resp = httpx.post(f"{url}/get_reward", json=body, headers=AUTH, timeout=5)
        assert resp.json() == {"rewards": pytest.approx(expected), "scores": pytest.approx(expected)}

    def test_openrlhf_reward_function_source_behind_the_server(self):
        # The trainer's FunctionRewardSource around the task's OpenRLHF-contract reward_func.
        from engines.rewards.function import FunctionRewardSource

        source = FunctionRewardSource("engines.toy.task:reward_func", timeout_s=10, batch_size=64, name="digits")

        async def main(url):
            async with httpx.AsyncClient(timeout=10) as http:
                return await asyncio.wait_for(
                    asyncio.gather(
                        *(http.post(f"{url}/score", json=digits_request(i)[0], headers=AUTH) for i in range(16))
                    ),
                    60,
                )

        with serve_in_thread(build_app(source, TOKEN, max_wait_ms=50)) as url:
            answers = asyncio.run(main(url))
            served = stats(url)
        for i, resp in enumerate(answers):
            assert resp.status_code == 200 and resp.json()["rewards"] == pytest.approx(digits_request(i)[1])
        assert served["model_batches"] < 16


class TestRejections:
    @pytest.mark.parametrize(
        "headers",
        [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}, {"Authorization": "Bearer"}],
    )
    def test_missing_or_wrong_token_is_401(self, digits_server, headers):
        url, _ = digits_server
        body, _ = digits_request(1)
        assert httpx.post(f"{url}/score", json=body, headers=headers, timeout=5).status_code == 401
        assert httpx.get(f"{url}/stats", headers=headers, timeout=5).status_code == 401

    def test_health_needs_no_token_and_reports_identity(self, digits_server):
        url, _ = digits_server
        assert httpx.get(f"{url}/health", timeout=5).json() == {
            "status": "ok",
            "source": "digits",
            "identity": "digits-v1",
        }

    def test_oversized_requests_are_413(self, digits_server):
        url, _ = digits_server
        too_many = {"query": ["say 1 : 1"] * 17}  # the limit is 16 items
        assert httpx.post(f"{url}/score", json=too_many, headers=AUTH, timeout=5).status_code == 413
        too_big = {"query": ["1 " * 40_000]}  # 80 kB > 64 kB
        resp = httpx.post(f"{url}/score", json=too_big, headers=AUTH, timeout=5)
        assert resp.status_code == 413 and "limit" in resp.json()["detail"]

    @pytest.mark.parametrize(
        "content",
        [
            b"{not json",
            b'{"query": "one string"}',
            b'{"prompts": ["a"]}',
            b'{"query": ["a", "b"], "prompts": ["a"]}',
            b"\xff\xfe",
        ],
    )
    def test_malformed_is_422_and_the_server_keeps_serving(self, digits_server, content):
        url, _ = digits_server
        resp = httpx.post(f"{url}/score", content=content, headers=AUTH, timeout=5)
        assert resp.status_code == 422
        body, expected = digits_request(5)
        good = httpx.post(f"{url}/score", json=body, headers=AUTH, timeout=5)
        assert good.status_code == 200 and good.json()["rewards"] == pytest.approx(expected)

    def test_source_error_is_500_naming_the_sample_and_spares_other_requests(self, digits_server):
        url, _ = digits_server
        bad = {"query": ["say 1 : 1", "say 2 : 2"], "labels": ["1", "boom"]}

        async def main():
            async with httpx.AsyncClient(timeout=10) as http:
                return await asyncio.gather(
                    http.post(f"{url}/score", json=bad, headers=AUTH),
                    *(http.post(f"{url}/score", json=digits_request(i)[0], headers=AUTH) for i in range(4)),
                )

        bad_resp, *good = asyncio.run(main())
        assert bad_resp.status_code == 500 and "item 1" in bad_resp.json()["detail"]
        for i, resp in enumerate(good):
            assert resp.status_code == 200 and resp.json()["rewards"] == pytest.approx(digits_request(i)[1])


def remote_batch(indices) -> tuple[RewardBatch, list[float]]:
    rows, expected = [], []
    for i in indices:
        body, exp = digits_request(i)
        rows.append((body["prompts"][0], body["query"][0][len(body["prompts"][0]) :], body["labels"][0]))
        expected.append(exp[0])
    prompts, responses, labels = map(list, zip(*rows))
    n = len(rows)
    return RewardBatch(prompts, responses, [[]] * n, [[]] * n, labels, sample_ids=[f"s{i}" for i in indices]), expected


class TestRemoteRewardSource:
    def test_scores_in_chunks_and_reports_server_identity(self, digits_server):
        url, _ = digits_server
        remote = RemoteRewardSource(url, name="rm", token=TOKEN, timeout_s=5, batch_size=4)
        batch, expected = remote_batch(range(10))
        assert remote.score(batch) == pytest.approx(expected)
        assert remote.http_calls == 3  # ceil(10 / 4) chunks, no retries
        assert remote.identity.endswith("/score|digits-v1")
        remote.close()

    def test_retries_a_5xx_then_succeeds(self):
        source = DigitsSource(fail_first_calls=1)
        with serve_in_thread(build_app(source, TOKEN, max_wait_ms=1)) as url:
            remote = RemoteRewardSource(f"{url}/get_reward", name="rm", token=TOKEN, timeout_s=5, backoff_s=0.01)
            batch, expected = remote_batch(range(3))
            assert remote.score(batch) == pytest.approx(expected)
            assert (remote.retries, source.calls) == (1, 2)
            remote.close()

    def test_wrong_token_fails_at_once_with_the_status(self, digits_server):
        url, _ = digits_server
        remote = RemoteRewardSource(url, name="rm", token="wrong", timeout_s=5, backoff_s=0.01)
        with pytest.raises(RewardError, match="HTTP 401.*s0..s1"):
            remote.score(remote_batch(range(2))[0])
        assert remote.http_calls == 1
        remote.close()

    def test_unreachable_server_fails_after_retries(self):
        with serve_in_thread(build_app(DigitsSource(), TOKEN)) as url:
            pass  # the port is free again once the server stopped
        remote = RemoteRewardSource(url, name="rm", token=TOKEN, timeout_s=2, max_retries=2, backoff_s=0.01)
        with pytest.raises(RewardError, match="after 3 attempts; last: ConnectError"):
            remote.score(remote_batch(range(1))[0])
        remote.close()

    def test_malformed_answer_fails_clearly(self):
        from fastapi import FastAPI

        app = FastAPI()
        answers = iter([{"rewards": [1.0]}, {"rewards": [1.0, "high"]}, {"scores": [1.0, 2.0]}])
        app.post("/score")(lambda: next(answers))
        with serve_in_thread(app) as url:
            remote = RemoteRewardSource(url, name="rm", token=None, timeout_s=5)
            batch = remote_batch(range(2))[0]
            for match in ("returned 1 rewards for 2 samples", "returned 'high' for s1", "without a 'rewards' list"):
                with pytest.raises(RewardError, match=match):
                    remote.score(batch)
            # No /health on this server: the identity is the endpoint alone.
            assert remote.identity == f"RemoteRewardSource|{url}/score"
            remote.close()

    def test_another_source_behind_the_url_is_another_identity(self):
        other = DigitsSource()
        other.identity = "digits-v2"
        with (
            serve_in_thread(build_app(DigitsSource(), TOKEN)) as url1,
            serve_in_thread(build_app(other, TOKEN)) as url2,
        ):
            remotes = [RemoteRewardSource(u, token=TOKEN) for u in (url1, url2)]
            first, second = (r.identity for r in remotes)
            for r in remotes:
                r.close()
        assert first.endswith("digits-v1") and second.endswith("digits-v2")


class TestRewardModelServer:
    def test_concurrent_clients_get_the_scores_of_one_by_one_scoring(self, tmp_path):
        from engines.rewards.model import RewardModelSource
        from engines.toy.reward_model import build_tiny_reward_model

        source = RewardModelSource(build_tiny_reward_model(tmp_path / "rm", seed=0), name="rm", batch_size=16)
        # Client i sends i % 3 + 1 texts of different lengths.
        requests = [[f"say {i % 10} :" + f" {i % 10}" * (i + j) for j in range(i % 3 + 1)] for i in range(16)]

        async def main(url):
            async with httpx.AsyncClient(timeout=30) as http:
                return await asyncio.wait_for(
                    asyncio.gather(*(http.post(f"{url}/score", json={"query": q}, headers=AUTH) for q in requests)), 120
                )

        with serve_in_thread(build_app(source, TOKEN, max_batch_size=64, max_wait_ms=50)) as url:
            answers = asyncio.run(main(url))
            served = stats(url)
            health = httpx.get(f"{url}/health", timeout=5).json()
        assert served["model_batches"] < len(requests)
        assert health["identity"] == source.identity
        for texts, resp in zip(requests, answers):
            assert resp.status_code == 200
            # One text per call, no padding at all; batched rows are right-padded, which a causal model
            # ignores, so only float32 rounding differs (~1e-7 seen; see tests/unit/test_reward_model.py).
            alone = [source.score(RewardBatch([""], [t], [[]], [[]], [None]))[0] for t in texts]
            assert resp.json()["rewards"] == pytest.approx(alone, abs=1e-5)
