"""Concurrency: one engine, many clients. Queue limits, disconnects, a small load test.

- Concurrent greedy requests get exactly the answers they get alone.
- Beyond --max-queue the server answers 429 (in each API's shape).
- A client that disconnects (streaming or not) frees its slot within a second,
  and the next request is unaffected.
- 8 concurrent streaming clients with cancellations, three rounds, against
  `specdecode serve` in a subprocess: every request completes or gets a clean
  error, and the server's RSS does not keep growing.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from server_util import ProcessServer, ThreadServer, client, smol_llm
from specdecode import SamplingParams

NAME = "smol"
LONG = {"model": NAME, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True,
        "temperature": 0, "stream": True}


def wait_idle(http: httpx.Client, within: float) -> float:
    """Seconds until /health shows nothing in flight; fails after `within`."""
    start = time.monotonic()
    while http.get("/health").json()["in_flight"]:
        assert time.monotonic() - start < within, "the slot was not freed in time"
        time.sleep(0.02)
    return time.monotonic() - start


class OpenStream:
    """A streaming request, read until its first generated text arrived, kept open."""

    def __init__(self, http: httpx.Client, body: dict, path: str = "/v1/completions") -> None:
        self.cm = http.stream("POST", path, json=body)
        response = self.cm.__enter__()
        assert response.status_code == 200
        self.lines = response.iter_lines()  # closing this iterator closes the connection
        for line in self.lines:
            if line.startswith("data: ") and '"text":"' in line and '"text":""' not in line:
                break
            if '"text_delta"' in line:
                break

    def close(self) -> None:
        """The client goes away mid-stream."""
        self.lines.close()
        self.cm.__exit__(None, None, None)


@pytest.fixture(scope="module")
def one_slot():
    with ThreadServer(smol_llm(), model_name=NAME, max_queue=1) as s:
        yield s


def test_queue_full_gets_429_in_both_shapes(one_slot):
    with client(one_slot.url) as http:
        first = OpenStream(http, LONG)  # generating
        second = http.stream("POST", "/v1/completions", json=LONG)
        assert second.__enter__().status_code == 200  # waiting (nothing to read yet)
        assert http.get("/health").json() | {"model": 0} == {
            "status": "ok", "model": 0, "in_flight": 2, "waiting": 1, "max_queue": 1}
        r = http.post("/v1/chat/completions",
                      json={"model": NAME, "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        assert r.headers["Retry-After"] == "1"
        r = http.post("/v1/messages", json={"model": NAME, "max_tokens": 4,
                                            "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 429
        assert r.json()["error"]["type"] == "rate_limit_error" and r.json()["type"] == "error"
        assert int(r.headers["Retry-After"]) >= 1
        second.__exit__(None, None, None)
        first.close()
        assert wait_idle(http, within=1.0) < 1.0
        metrics = http.get("/metrics").text
        assert 'specdecode_requests_total{route="/v1/messages",status="429"} 1.0' in metrics
        assert 'specdecode_generations_total{outcome="cancelled"}' in metrics


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/messages"])
def test_stream_disconnect_frees_slot_and_next_is_unaffected(one_slot, path):
    llm = smol_llm()
    want = llm.generate(llm.encode("Once upon a time"), SamplingParams(max_tokens=8))
    body = LONG if path == "/v1/completions" else {
        "model": NAME, "max_tokens": 400, "stream": True, "temperature": 0,
        "messages": [{"role": "user", "content": "Tell me a long story."}]}
    with client(one_slot.url) as http:
        OpenStream(http, body, path).close()
        assert wait_idle(http, within=1.0) < 1.0
        r = http.post("/v1/completions", json={"model": NAME, "prompt": "Once upon a time",
                                               "max_tokens": 8, "temperature": 0})
        assert r.json()["choices"][0]["text"] == want.text


def test_non_streaming_disconnect_frees_slot(one_slot):
    body = LONG | {"stream": False}
    with client(one_slot.url, timeout=0.5) as impatient, pytest.raises(httpx.ReadTimeout):
        impatient.post("/v1/completions", json=body)
    with client(one_slot.url) as http:
        assert wait_idle(http, within=1.0) < 1.0


def test_concurrent_requests_equal_solo_answers():
    prompts = [f"Write one sentence about the number {i}." for i in range(6)]
    with ThreadServer(smol_llm(), model_name=NAME, max_queue=8) as s:
        oai = openai.OpenAI(base_url=f"{s.url}/v1", api_key="none", max_retries=0, timeout=120)

        def ask(p: str) -> str:
            r = oai.chat.completions.create(model=NAME, temperature=0, max_tokens=10,
                                            messages=[{"role": "user", "content": p}])
            return r.choices[0].message.content

        alone = [ask(p) for p in prompts]
        with ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(ask, prompts))
    assert together == alone and len(set(alone)) > 1


def _stream_client(url: str, i: int, cancel: bool) -> str:
    body = {"model": "default", "temperature": 0, "max_tokens": 8, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": f"Count to {i + 3}."}]}
    with client(url, "load-key", timeout=120) as http, \
            http.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            error = json.loads(r.read())["error"]
            return f"error {r.status_code} {error['type']}"
        events = 0
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return "done"
            events += 1
            if cancel and events == 3:
                return "cancelled"
        return "truncated"


def test_load_against_cli_server():
    with ProcessServer("--target", "smollm2-135m", "--drafter", "ngram", "-k", "4",
                       "--dtype", "float32", "--max-context", "512", "--max-queue", "16",
                       "--api-key", "load-key") as s:
        rss = []
        for _ in range(3):
            with ThreadPoolExecutor(8) as pool:
                outcomes = list(pool.map(lambda i: _stream_client(s.url, i, i % 3 == 2),
                                         range(8)))
            assert outcomes.count("cancelled") == 2 and outcomes.count("done") == 6, outcomes
            with client(s.url, "load-key") as http:
                wait_idle(http, within=2.0)
            rss.append(s.rss())
        growth = rss[-1] - rss[0]
        assert growth < 64 << 20, f"RSS grew by {growth >> 20} MiB over rounds: {rss}"
        with client(s.url, "load-key") as http:
            metrics = http.get("/metrics").text
        finished = [line for line in metrics.splitlines()
                    if line.startswith('specdecode_generations_total{outcome="finished"}')]
        assert float(finished[0].split()[-1]) >= 18

