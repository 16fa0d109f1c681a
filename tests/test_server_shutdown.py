"""Graceful shutdown: on SIGTERM `specdecode serve` drains, then stops what is left.

Requests in flight past the drain (5 s) end cleanly: a non-streaming one gets
a 503 in its API's error shape, a stream a final error event; the process
then exits on its own.
"""

from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import real
from server_util import ProcessServer, client

LONG = {"model": "default", "prompt": "Once upon a time", "max_tokens": 4000,
        "ignore_eos": True, "temperature": 0}
ANT_STREAM = {"model": "default", "max_tokens": 4000, "stream": True, "temperature": 0,
              "messages": [{"role": "user", "content": "Tell me a very long story."}]}


def stream_events(url: str) -> list[dict]:
    """The events of an Anthropic stream, read to its end."""
    with client(url, timeout=60) as http, http.stream("POST", "/v1/messages",
                                                      json=ANT_STREAM) as r:
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]


def test_sigterm_drains_then_answers_503_and_exits():
    real.path("smollm2-135m")
    server = ProcessServer("--target", "smollm2-135m", "--drafter", "ngram", "--dtype",
                           "float32", "--max-context", "8192")
    with server as s, ThreadPoolExecutor(3) as pool, client(s.url, timeout=60) as http:
        running = pool.submit(http.post, "/v1/completions", json=LONG)
        streaming = pool.submit(stream_events, s.url)
        waiting = pool.submit(http.post, "/v1/completions", json=LONG | {"seed": 1})
        deadline = time.monotonic() + 30
        while http.get("/health").json()["in_flight"] < 3:
            assert time.monotonic() < deadline, "the requests did not start"
            time.sleep(0.1)
        start = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        r = running.result(timeout=30)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "server_shutting_down"
        events = streaming.result(timeout=30)
        assert events[-1]["type"] == "error"
        assert events[-1]["error"]["type"] == "overloaded_error"
        assert waiting.result(timeout=30).status_code == 503
        s.proc.wait(timeout=30)
        assert time.monotonic() - start < 15
        with pytest.raises(httpx.TransportError):  # no longer serving
            http.get("/health", timeout=2)
