"""Bad requests get a 4xx in the right API's error shape: never a 5xx, never a traceback."""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass

import pytest

from server_util import HOST, ThreadServer, client, smol_llm
from specdecode.text import MAX_STOP_CHARS, MAX_STOP_STRINGS

KEY = "k-errors"
NAME = "smol"
MSG = [{"role": "user", "content": "hi"}]
CHAT = {"model": NAME, "messages": MSG, "max_tokens": 2}
COMP = {"model": NAME, "prompt": "hi", "max_tokens": 2}
ANT = {"model": NAME, "max_tokens": 2, "messages": MSG}


def without(body: dict, key: str) -> dict:
    return {k: v for k, v in body.items() if k != key}


@dataclass
class Raw:
    """A body sent as is, with its own Content-Type."""

    content: str
    content_type: str


LONG_STOP = "x" * (MAX_STOP_CHARS + 1)
MANY_STOPS = [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]
TEXT_PART = [{"role": "user", "content": [{"type": "text"}]}]


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
    ("stop-too-long", "POST", "/v1/chat/completions", CHAT | {"stop": LONG_STOP}, 400, "stop"),
    ("stop-list-too-long", "POST", "/v1/chat/completions", CHAT | {"stop": ["a", LONG_STOP]},
     400, "stop"),
    ("stop-too-many", "POST", "/v1/chat/completions", CHAT | {"stop": MANY_STOPS}, 400,
     "stop"),
    ("comp-stop-too-long", "POST", "/v1/completions", COMP | {"stop": LONG_STOP}, 400, "stop"),
    ("ant-stop-too-long", "POST", "/v1/messages", ANT | {"stop_sequences": [LONG_STOP]}, 400,
     None),
    ("ant-stop-too-many", "POST", "/v1/messages", ANT | {"stop_sequences": MANY_STOPS}, 400,
     None),
    ("ant-stop-empty", "POST", "/v1/messages", ANT | {"stop_sequences": [""]}, 400, None),
    ("top-logprobs", "POST", "/v1/chat/completions", CHAT | {"top_logprobs": 2}, 400,
     "top_logprobs"),
    ("top-logprobs-string", "POST", "/v1/chat/completions", CHAT | {"top_logprobs": "2"}, 400,
     "top_logprobs"),
    ("tool-choice-auto", "POST", "/v1/chat/completions", CHAT | {"tool_choice": "auto"}, 400,
     "tool_choice"),
    ("tool-choice-function", "POST", "/v1/chat/completions",
     CHAT | {"tool_choice": {"type": "function", "function": {"name": "f"}}}, 400,
     "tool_choice"),
    ("functions", "POST", "/v1/chat/completions", CHAT | {"functions": [{"name": "f"}]}, 400,
     "functions"),
    ("function-call", "POST", "/v1/chat/completions", CHAT | {"function_call": "auto"}, 400,
     "function_call"),
    ("modalities-audio", "POST", "/v1/chat/completions",
     CHAT | {"modalities": ["text", "audio"]}, 400, "modalities"),
    ("audio", "POST", "/v1/chat/completions", CHAT | {"audio": {"voice": "x"}}, 400, "audio"),
    ("prediction", "POST", "/v1/chat/completions",
     CHAT | {"prediction": {"type": "content", "content": "x"}}, 400, "prediction"),
    ("response-format-json", "POST", "/v1/chat/completions",
     CHAT | {"response_format": {"type": "json_object"}}, 400, "response_format"),
    ("logit-bias", "POST", "/v1/chat/completions", CHAT | {"logit_bias": {"5": 1.0}}, 400,
     "logit_bias"),
    ("frequency-penalty", "POST", "/v1/chat/completions", CHAT | {"frequency_penalty": 0.5},
     400, "frequency_penalty"),
    ("top-k-negative", "POST", "/v1/chat/completions", CHAT | {"top_k": -1}, 400, "top_k"),
    ("min-p-above-one", "POST", "/v1/chat/completions", CHAT | {"min_p": 1.5}, 400, "min_p"),
    ("chat-name-int", "POST", "/v1/chat/completions",
     CHAT | {"messages": [{"role": "user", "content": "x", "name": 3}]}, 400,
     "messages[0].name"),
    ("chat-text-part-without-text", "POST", "/v1/chat/completions",
     CHAT | {"messages": TEXT_PART}, 400, "messages[0].content[0].text"),
    ("chat-text-part-text-int", "POST", "/v1/chat/completions",
     CHAT | {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}, 400,
     "messages[0].content"),
    ("comp-suffix", "POST", "/v1/completions", COMP | {"suffix": "x"}, 400, "suffix"),
    ("comp-logprobs", "POST", "/v1/completions", COMP | {"logprobs": 2}, 400, "logprobs"),
    ("comp-best-of", "POST", "/v1/completions", COMP | {"best_of": 2}, 400, "best_of"),
    ("ant-tool-choice", "POST", "/v1/messages", ANT | {"tool_choice": {"type": "auto"}}, 400,
     None),
    ("ant-tools", "POST", "/v1/messages", ANT | {"tools": [{"name": "f"}]}, 400, None),
    ("ant-thinking", "POST", "/v1/messages",
     ANT | {"thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, None),
    ("ant-top-k-negative", "POST", "/v1/messages", ANT | {"top_k": -1}, 400, None),
    ("ant-stream-string", "POST", "/v1/messages", ANT | {"stream": "yes"}, 400, None),
    ("ant-content-int", "POST", "/v1/messages",
     ANT | {"messages": [{"role": "user", "content": 4}]}, 400, None),
    ("ant-text-block-without-text", "POST", "/v1/messages", ANT | {"messages": TEXT_PART},
     400, None),
    ("ant-system-block-without-text", "POST", "/v1/messages",
     ANT | {"system": [{"type": "text"}]}, 400, None),
    ("chat-text-plain", "POST", "/v1/chat/completions", Raw(json.dumps(CHAT), "text/plain"),
     415, None),
    ("chat-form", "POST", "/v1/chat/completions",
     Raw(json.dumps(CHAT), "application/x-www-form-urlencoded"), 415, None),
    ("comp-text-plain", "POST", "/v1/completions",
     Raw(json.dumps(COMP), "text/plain; charset=utf-8"), 415, None),
    ("ant-text-plain", "POST", "/v1/messages", Raw(json.dumps(ANT), "text/plain"), 415, None),
    ("ant-form", "POST", "/v1/messages", Raw(json.dumps(ANT), "multipart/form-data"), 415,
     None),
    ("chat-long-model-name", "POST", "/v1/chat/completions", CHAT | {"model": "m" * 100000},
     404, "model"),
    # other engines' extensions that change the output: refused, not ignored
    ("chat-repetition-penalty", "POST", "/v1/chat/completions",
     CHAT | {"repetition_penalty": 1.2}, 400, "repetition_penalty"),
    ("chat-guided-json", "POST", "/v1/chat/completions",
     CHAT | {"guided_json": {"type": "object"}}, 400, "guided_json"),
    ("comp-min-tokens", "POST", "/v1/completions", COMP | {"min_tokens": 5}, 400,
     "min_tokens"),
    ("comp-grammar", "POST", "/v1/completions", COMP | {"grammar": "root ::= \"a\""}, 400,
     "grammar"),
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
    if isinstance(body, Raw):
        return http.request(method, path, content=body.content,
                            headers={"Content-Type": body.content_type})
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
    assert len(CASES) >= 80
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


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", CHAT | {"max_tokens": 3, "stop": ["x" * 1_000_000]}),
    ("/v1/messages", ANT | {"max_tokens": 3, "stop_sequences": ["x" * 1_000_000]})])
def test_megabyte_stop_string_is_refused_promptly(http, path, body):
    start = time.monotonic()
    r = send(http, "POST", path, body)
    assert r.status_code == 400 and f"at most {MAX_STOP_CHARS} characters" in r.text
    assert time.monotonic() - start < 5  # it held the engine 66 s


def test_head_on_health_and_models(http):
    for path in ("/health", "/v1/models", f"/v1/models/{NAME}"):
        r = http.head(path)
        assert r.status_code == 200 and r.content == b"", path


def test_long_names_are_not_echoed_in_full(http):
    r = send(http, "POST", "/v1/chat/completions", CHAT | {"model": "m" * 500_000})
    assert r.status_code == 404 and len(r.content) < 1000
    assert "(500000 characters)" in r.json()["error"]["message"]
    r = http.get("/v1/" + "p" * 20_000)
    assert r.status_code == 404 and len(r.content) < 1000


def test_text_part_without_text_is_named(http):
    r = send(http, "POST", "/v1/chat/completions", CHAT | {"messages": TEXT_PART})
    assert "needs a 'text' string" in r.json()["error"]["message"], r.text
    r = send(http, "POST", "/v1/chat/completions", Raw(json.dumps(CHAT), "text/plain"))
    assert "'text/plain'" in r.json()["error"]["message"]


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT),
                                        ("/v1/completions", COMP), ("/v1/messages", ANT)])
def test_a_body_without_content_type_is_read_as_json(http, path, body):
    """As the README says (curl -d without -H sends a form type; raw clients send none)."""
    r = http.post(path, content=json.dumps(body).encode())
    assert "content-type" not in {k.lower() for k in r.request.headers}
    assert r.status_code == 200, r.text


def test_extensions_at_their_neutral_value_and_unknown_fields_pass(http):
    """A client that sends vLLM's defaults, or fields nothing reads, is served."""
    neutral = {"repetition_penalty": 1.0, "min_tokens": 0, "stop_token_ids": [],
               "use_beam_search": False, "guided_json": None, "metadata": {"a": "b"}}
    r = send(http, "POST", "/v1/chat/completions", CHAT | neutral)
    assert r.status_code == 200, r.text


def test_a_template_that_refuses_the_messages_is_a_400_saying_why(monkeypatch):
    """A strict template's raise_exception: the 400 says what the template said, once."""
    llm = smol_llm()
    assert llm.tokenizer.control_tokens  # cached from the real template
    monkeypatch.setattr(llm.tokenizer.hf, "chat_template", (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('roles must alternate') }}"
        "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"))
    with ThreadServer(llm, model_name=NAME) as s, client(s.url) as http:
        r = send(http, "POST", "/v1/chat/completions",
                 CHAT | {"messages": [{"role": "assistant", "content": "x"}]})
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert message == "the chat template refused these messages: roles must alternate"
        r = send(http, "POST", "/v1/messages", ANT | {"messages": [
            {"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]})
        assert r.status_code == 400 and "roles must alternate" in r.json()["error"]["message"]


def _read_until_closed(sock: socket.socket) -> bytes:
    """The whole reply: the server closes the connection after its 408."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def test_body_read_timeout():
    with ThreadServer(smol_llm(), model_name=NAME, body_timeout=1.0) as s:
        request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                   b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
        start = time.monotonic()
        with socket.create_connection((HOST, s.port), timeout=10) as sock:
            sock.sendall(request)
            reply = _read_until_closed(sock)
        assert time.monotonic() - start < 4  # it held the connection ~130 s
    assert reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply
