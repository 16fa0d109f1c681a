"""Bad requests get a 4xx in the right API's error shape: never a 5xx, never a traceback."""

from __future__ import annotations

import json

import pytest

from server_util import ThreadServer, client, smol_llm

KEY = "k-errors"
NAME = "smol"
MSG = [{"role": "user", "content": "hi"}]
CHAT = {"model": NAME, "messages": MSG, "max_tokens": 2}
COMP = {"model": NAME, "prompt": "hi", "max_tokens": 2}
ANT = {"model": NAME, "max_tokens": 2, "messages": MSG}


def without(body: dict, key: str) -> dict:
    return {k: v for k, v in body.items() if k != key}


# (id, method, path, body (dict/list -> JSON, str -> raw bytes), status, param or None)
CASES = [
    ("chat-no-messages", "POST", "/v1/chat/completions", without(CHAT, "messages"), 400,
     "messages"),
    ("chat-empty-messages", "POST", "/v1/chat/completions", CHAT | {"messages": []}, 400,
     "messages"),
    ("chat-messages-string", "POST", "/v1/chat/completions", CHAT | {"messages": "hi"}, 400,
     "messages"),
    ("chat-no-role", "POST", "/v1/chat/completions", CHAT | {"messages": [{"content": "x"}]},
     400, "messages[0].role"),
    ("chat-bad-role", "POST", "/v1/chat/completions",
     CHAT | {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ("chat-content-int", "POST", "/v1/chat/completions",
     CHAT | {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("chat-image-part", "POST", "/v1/chat/completions",
     CHAT | {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content[0]"),
    ("chat-no-model", "POST", "/v1/chat/completions", without(CHAT, "model"), 400, "model"),
    ("chat-model-int", "POST", "/v1/chat/completions", CHAT | {"model": 3}, 400, "model"),
    ("chat-unknown-model", "POST", "/v1/chat/completions", CHAT | {"model": "gpt-4o"}, 404,
     "model"),
    ("temperature-string", "POST", "/v1/chat/completions", CHAT | {"temperature": "hot"}, 400,
     "temperature"),
    ("temperature-bool", "POST", "/v1/chat/completions", CHAT | {"temperature": True}, 400,
     "temperature"),
    ("temperature-negative", "POST", "/v1/chat/completions", CHAT | {"temperature": -1}, 400,
     "temperature"),
    ("temperature-too-high", "POST", "/v1/chat/completions", CHAT | {"temperature": 3}, 400,
     "temperature"),
    ("top-p-zero", "POST", "/v1/chat/completions", CHAT | {"top_p": 0}, 400, "top_p"),
    ("top-p-above-one", "POST", "/v1/chat/completions", CHAT | {"top_p": 1.5}, 400, "top_p"),
    ("max-tokens-zero", "POST", "/v1/chat/completions", CHAT | {"max_tokens": 0}, 400,
     "max_tokens"),
    ("max-tokens-string", "POST", "/v1/chat/completions", CHAT | {"max_tokens": "10"}, 400,
     "max_tokens"),
    ("max-tokens-float", "POST", "/v1/chat/completions", CHAT | {"max_tokens": 1.5}, 400,
     "max_tokens"),
    ("max-completion-tokens-neg", "POST", "/v1/chat/completions",
     CHAT | {"max_completion_tokens": -3}, 400, "max_completion_tokens"),
    ("n-two", "POST", "/v1/chat/completions", CHAT | {"n": 2}, 400, "n"),
    ("stop-int", "POST", "/v1/chat/completions", CHAT | {"stop": 5}, 400, "stop"),
    ("stop-empty-string", "POST", "/v1/chat/completions", CHAT | {"stop": [""]}, 400, "stop"),
    ("seed-negative", "POST", "/v1/chat/completions", CHAT | {"seed": -1}, 400, "seed"),
    ("stream-string", "POST", "/v1/chat/completions", CHAT | {"stream": "yes"}, 400,
     "stream"),
    ("stream-options-no-stream", "POST", "/v1/chat/completions",
     CHAT | {"stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("logprobs", "POST", "/v1/chat/completions", CHAT | {"logprobs": True}, 400, "logprobs"),
    ("tools", "POST", "/v1/chat/completions", CHAT | {"tools": [{"type": "function"}]}, 400,
     "tools"),
    ("presence-penalty", "POST", "/v1/chat/completions", CHAT | {"presence_penalty": 1.0},
     400, "presence_penalty"),
    ("chat-body-list", "POST", "/v1/chat/completions", [CHAT], 422, None),
    ("chat-invalid-json", "POST", "/v1/chat/completions", '{"model": ', 400, None),
    ("chat-too-long-prompt", "POST", "/v1/chat/completions",
     CHAT | {"messages": [{"role": "user", "content": "hello " * 1100}]}, 400, "messages"),
    ("comp-no-prompt", "POST", "/v1/completions", without(COMP, "prompt"), 400, "prompt"),
    ("comp-prompt-int", "POST", "/v1/completions", COMP | {"prompt": 5}, 400, "prompt"),
    ("comp-batched", "POST", "/v1/completions", COMP | {"prompt": ["a", "b"]}, 400, "prompt"),
    ("comp-token-out-of-vocab", "POST", "/v1/completions", COMP | {"prompt": [10**7]}, 400,
     "prompt"),
    ("comp-empty-ids", "POST", "/v1/completions", COMP | {"prompt": []}, 400, "prompt"),
    ("comp-echo", "POST", "/v1/completions", COMP | {"echo": True}, 400, "echo"),
    ("comp-unknown-model", "POST", "/v1/completions", COMP | {"model": "x"}, 404, "model"),
    ("comp-too-long-ids", "POST", "/v1/completions", COMP | {"prompt": [1] * 1024}, 400,
     "prompt"),
    ("ant-no-max-tokens", "POST", "/v1/messages", without(ANT, "max_tokens"), 400, None),
    ("ant-max-tokens-zero", "POST", "/v1/messages", ANT | {"max_tokens": 0}, 400, None),
    ("ant-no-messages", "POST", "/v1/messages", without(ANT, "messages"), 400, None),
    ("ant-system-role", "POST", "/v1/messages",
     ANT | {"messages": [{"role": "system", "content": "x"}]}, 400, None),
    ("ant-temperature-1.5", "POST", "/v1/messages", ANT | {"temperature": 1.5}, 400, None),
    ("ant-stop-sequences-string", "POST", "/v1/messages", ANT | {"stop_sequences": "x"}, 400,
     None),
    ("ant-prefill", "POST", "/v1/messages",
     ANT | {"messages": [*MSG, {"role": "assistant", "content": "x"}]}, 400, None),
    ("ant-image-block", "POST", "/v1/messages",
     ANT | {"messages": [{"role": "user", "content": [{"type": "image"}]}]}, 400, None),
    ("ant-system-int", "POST", "/v1/messages", ANT | {"system": 7}, 400, None),
    ("ant-unknown-model", "POST", "/v1/messages", ANT | {"model": "claude-x"}, 404, None),
    ("ant-body-list", "POST", "/v1/messages", [ANT], 422, None),
    ("ant-too-long", "POST", "/v1/messages",
     ANT | {"messages": [{"role": "user", "content": "hello " * 1100}]}, 400, None),
    ("comp-lone-surrogate", "POST", "/v1/completions",
     '{"model": "smol", "prompt": "\\ud800"}', 400, "prompt"),
    ("chat-lone-surrogate", "POST", "/v1/chat/completions",
     '{"model": "smol", "messages": [{"role": "user", "content": "\\ud800"}]}', 400,
     "messages"),
    ("model-lone-surrogate", "POST", "/v1/completions",
     '{"model": "\\ud800", "prompt": "x"}', 404, "model"),
    ("temperature-nan", "POST", "/v1/completions",
     '{"model": "smol", "prompt": "x", "temperature": NaN}', 400, "temperature"),
    ("seed-10000-digits", "POST", "/v1/completions",
     '{"model": "smol", "prompt": "x", "seed": 1' + "0" * 10000 + "}", 400, None),
    ("deeply-nested-json", "POST", "/v1/completions", "[" * 50000 + "]" * 50000, 400, None),
    ("null-body", "POST", "/v1/chat/completions", "null", 422, None),
    ("empty-body", "POST", "/v1/chat/completions", "", 422, None),
    ("unknown-route", "GET", "/v1/engines", None, 404, None),
    ("wrong-method", "GET", "/v1/chat/completions", None, 405, None),
    ("post-models", "POST", "/v1/models", {}, 405, None),
]


@pytest.fixture(scope="module")
def server():
    with ThreadServer(smol_llm(), api_key=KEY, model_name=NAME, max_queue=2) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with client(server.url, KEY) as c:
        yield c


def send(http, method: str, path: str, body):
    if body is None:
        return http.request(method, path)
    content = body if isinstance(body, str) else json.dumps(body)
    return http.request(method, path, content=content,
                        headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_request(http, case):
    _, method, path, body, status, param = case
    r = send(http, method, path, body)
    assert r.status_code == status, r.text
    assert "Traceback" not in r.text
    err = r.json()
    if path == "/v1/messages":
        assert err["type"] == "error" and set(err["error"]) == {"type", "message"}
        assert err["error"]["type"] == ("not_found_error" if status == 404
                                        else "invalid_request_error")
        assert err["error"]["message"]
    else:
        assert set(err) == {"error"}
        assert set(err["error"]) == {"message", "type", "param", "code"}
        assert err["error"]["message"]
        if param is not None:
            assert err["error"]["param"] == param


def test_context_limit_has_code(http):
    r = send(http, "POST", "/v1/completions", COMP | {"prompt": [1] * 2000})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_body_too_large(http):
    big = CHAT | {"messages": [{"role": "user", "content": "x" * (2 << 20)}]}
    r = send(http, "POST", "/v1/chat/completions", big)
    assert r.status_code == 413 and "larger than" in r.json()["error"]["message"]
    r = send(http, "POST", "/v1/messages", ANT | {"system": "x" * (2 << 20)})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"


@pytest.mark.parametrize("extreme", [
    {"temperature": 1e-300}, {"temperature": 1.0, "top_p": 1e-300, "seed": 2**64 - 1},
    {"temperature": 2.0, "top_k": 10**12, "min_p": 1.0}, {"max_tokens": 1, "stop": "\ud800"},
])
def test_extreme_valid_values_generate(http, extreme):
    r = send(http, "POST", "/v1/completions", COMP | extreme)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def test_still_serves_after_bad_input(http):
    assert len(CASES) >= 20
    r = send(http, "POST", "/v1/chat/completions", CHAT | {"temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert http.get("/health").json()["in_flight"] == 0


@pytest.mark.parametrize("argv", [["serve", "--port", "99999"], ["serve", "--max-queue", "-1"],
                                  ["serve", "--port", "http"]])
def test_cli_serve_bad_flags(capsys, argv):
    from specdecode.cli import main

    assert main(argv) == 2  # before any model is loaded
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
