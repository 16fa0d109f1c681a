"""The server through the official `openai` and `anthropic` clients (SmolLM2-135M, loopback).

Greedy answers over HTTP are exactly what the library returns for the same
request; usage carries the speculative stats; stop sequences, seeds, model
listing, health, metrics and API keys behave as documented.
"""

from __future__ import annotations

import anthropic
import openai
import pytest

from injection import control_ids, conversation, hostile
from server_util import ThreadServer, client, smol_llm
from specdecode import SamplingParams

KEY = "test-key-123"
NAME = "smol"
CHAT = [{"role": "user", "content": "List three colors, one per line."}]
PROMPT = "def add(a, b):\n"
GREEDY = {"temperature": 0}  # recent anthropic SDKs no longer take sampling arguments
SPEC_FIELDS = {"drafter", "k", "steps", "drafted", "accepted", "acceptance_rate",
               "mean_accepted_length", "tokens_per_second", "drafter_steps",
               "guard_plain_steps", "guard_engagements", "speculation_paused", "drafter_errors"}


@pytest.fixture(scope="module")
def server():
    with ThreadServer(smol_llm(), api_key=KEY, model_name=NAME, max_queue=4) as s:
        yield s


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def ant(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


def expected(messages=None, prompt=None, **kw):
    llm = smol_llm()
    ids = llm.encode(prompt, messages)
    return llm.generate(ids, SamplingParams(**kw)), len(ids)


def test_models(oai):
    assert [m.id for m in oai.models.list().data] == [NAME]
    assert oai.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("gpt-4")


def test_chat_equals_library_and_carries_stats(oai):
    want, n_prompt = expected(CHAT, temperature=0.0, max_tokens=12)
    r = oai.chat.completions.create(model=NAME, messages=CHAT, temperature=0, max_tokens=12)
    assert r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == want.finish_reason
    assert r.model == NAME and r.object == "chat.completion"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt,
                                                                  want.completion_tokens)
    spec = r.usage.model_extra["speculative"]
    assert set(spec) == SPEC_FIELDS
    assert (spec["drafted"], spec["accepted"], spec["steps"]) == (
        want.stats.drafted, want.stats.accepted, want.stats.steps)
    assert spec["acceptance_rate"] == round(want.stats.acceptance_rate, 4)
    assert spec["drafter"] == "ngram" and spec["k"] == 4


def test_chat_stream_with_usage(oai):
    want, n_prompt = expected(CHAT, temperature=0.0, max_tokens=12)
    chunks = list(oai.chat.completions.create(
        model=NAME, messages=CHAT, temperature=0, max_completion_tokens=12, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == want.finish_reason and not any(finishes[:-1])
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == want.completion_tokens
    assert usage.prompt_tokens == n_prompt
    assert usage.model_extra["speculative"]["drafted"] == want.stats.drafted
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_plain_and_stream(oai):
    want, _ = expected(prompt=PROMPT, temperature=0.0, max_tokens=16)
    r = oai.completions.create(model=NAME, prompt=PROMPT, temperature=0, max_tokens=16)
    assert r.choices[0].text == want.text
    assert r.usage.completion_tokens == want.completion_tokens
    assert r.usage.model_extra["speculative"]["steps"] == want.stats.steps
    stream = oai.completions.create(model="default", prompt=PROMPT, temperature=0,
                                    max_tokens=16, stream=True)
    assert "".join(c.choices[0].text for c in stream) == want.text


def test_stop_strings_openai_and_anthropic(oai, ant):
    full, _ = expected(prompt=PROMPT, temperature=0.0, max_tokens=16)
    stop = full.text.strip()[4:7]
    assert stop and stop in full.text
    r = oai.completions.create(model=NAME, prompt=PROMPT, temperature=0, max_tokens=16,
                               stop=[stop, "never-seen"])
    assert r.choices[0].text == full.text[: full.text.index(stop)]
    assert r.choices[0].finish_reason == "stop"

    chat, _ = expected(CHAT, temperature=0.0, max_tokens=12)
    word = chat.text.split()[1]
    m = ant.messages.create(model=NAME, max_tokens=12, messages=CHAT, stop_sequences=[word],
                            extra_body=GREEDY)
    assert m.content[0].text == chat.text[: chat.text.index(word)]
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", word)


def test_seeded_sampling_repeats(oai):
    kw = dict(model=NAME, messages=CHAT, temperature=0.9, top_p=0.95, max_tokens=10, seed=7)
    a = oai.chat.completions.create(**kw).choices[0].message.content
    b = oai.chat.completions.create(**kw).choices[0].message.content
    assert a == b


def test_anthropic_message(ant):
    system = "You answer briefly."
    want, n_prompt = expected([{"role": "system", "content": system}, *CHAT],
                              temperature=0.0, max_tokens=10)
    m = ant.messages.create(model=NAME, max_tokens=10, system=system, messages=CHAT,
                            extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.model == NAME
    assert m.content[0].type == "text" and m.content[0].text == want.text
    assert m.stop_reason == ("max_tokens" if want.finish_reason == "length" else "end_turn")
    assert (m.usage.input_tokens, m.usage.output_tokens) == (n_prompt,
                                                             want.completion_tokens)
    assert m.usage.model_extra["speculative"]["drafted"] == want.stats.drafted


def test_anthropic_stream(ant):
    blocks = [{"type": "text", "text": "You answer briefly."}]
    want, n_prompt = expected([{"role": "system", "content": blocks[0]["text"]}, *CHAT],
                              temperature=0.0, max_tokens=10)
    with ant.messages.stream(model=NAME, max_tokens=10, system=blocks, extra_body=GREEDY,
                             messages=[{"role": "user",
                                        "content": [{"type": "text",
                                                     "text": CHAT[0]["content"]}]}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == want.text == final.content[0].text
    assert final.usage.output_tokens == want.completion_tokens
    assert final.usage.input_tokens == n_prompt
    assert final.stop_reason in ("max_tokens", "end_turn")

    with ant.messages.stream(model=NAME, max_tokens=4, messages=CHAT, extra_body=GREEDY) as s:
        types = [e.type for e in s]
    assert types[:2] == ["message_start", "content_block_start"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_health_metrics_and_auth(server, oai):
    with client(server.url) as c:
        assert c.get("/health").json()["status"] == "ok"  # open without a key
        for path in ("/metrics", "/v1/models"):
            r = c.get(path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert c.get("/v1/models", headers={"x-api-key": KEY}).status_code == 200
        assert c.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
        r = c.post("/v1/messages", json={}, headers={"x-api-key": "nope"})
        assert r.status_code == 401
        assert r.json() == {"type": "error", "error": {"type": "authentication_error",
                                                       "message": r.json()["error"]["message"]}}
    with client(server.url, KEY) as c:
        text = c.get("/metrics").text
    for name in ("specdecode_requests_total", "specdecode_completion_tokens_total",
                 "specdecode_drafted_tokens_total", "specdecode_accepted_tokens_total",
                 "specdecode_acceptance_rate_bucket", "specdecode_queue_depth",
                 "specdecode_time_per_output_token_seconds_bucket",
                 "specdecode_guard_engagements_total", "specdecode_guard_plain_steps_total",
                 "specdecode_speculation_paused", "specdecode_drafter_errors_total"):
        assert name in text
    tokens = [line for line in text.splitlines()
              if line.startswith("specdecode_completion_tokens_total")]
    assert float(tokens[0].split()[-1]) > 0
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    bad_ant = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(anthropic.AuthenticationError):
        bad_ant.messages.create(model=NAME, max_tokens=4, messages=CHAT)


def second_turn(oai, first: list[dict], between: list[dict], followup: str, n_first: int,
                n: int):
    """`first` answered, `between` sent, then first's turn 2 (its answer + `followup`):
    returns (turn 2's response, its messages, its prompt tokens); the answer is the
    library's for the same messages."""
    answer = oai.chat.completions.create(model=NAME, messages=first, temperature=0,
                                         max_tokens=n_first).choices[0].message.content
    turn2 = first + [{"role": "assistant", "content": answer},
                     {"role": "user", "content": followup}]
    want, n_prompt = expected(turn2, temperature=0.0, max_tokens=n)
    oai.chat.completions.create(model=NAME, messages=between, temperature=0, max_tokens=n_first)
    r = oai.chat.completions.create(model=NAME, messages=turn2, temperature=0, max_tokens=n)
    assert r.choices[0].message.content == want.text
    return r, turn2, n_prompt


def test_a_second_turn_reuses_the_first_from_the_prefix_cache(server, oai, ant):
    """Turn 2 of a conversation resends turn 1 and its answer: usage says how many prompt
    tokens came from the cache (OpenAI prompt_tokens_details.cached_tokens, Anthropic
    cache_read_input_tokens), /metrics counts them, and the answer is the library's."""
    r, turn2, n_prompt = second_turn(oai, CHAT, CHAT, "Now three animals.", 16, 12)
    cached = r.usage.prompt_tokens_details.cached_tokens
    assert n_prompt // 2 < cached < n_prompt
    m = ant.messages.create(model=NAME, max_tokens=12, messages=turn2, extra_body=GREEDY)
    assert m.usage.input_tokens == n_prompt and m.usage.cache_read_input_tokens == n_prompt - 1
    with client(server.url, KEY) as c:
        text = c.get("/metrics").text
    values = {line.split()[0]: float(line.split()[-1]) for line in text.splitlines()
              if line.startswith(("specdecode_prefix_cache", "specdecode_suffix_store"))}
    assert values["specdecode_prefix_cache_tokens_total"] >= cached
    assert values["specdecode_prefix_cache_hits_total"] >= 2
    assert values["specdecode_suffix_store_tokens"] == 0  # this server's drafter has none


def users(topic: str) -> list[dict]:
    """A conversation with a long system prompt of its own (over the store's 64 tokens)."""
    system = (f"You are a patient tutor for {topic}. " * 12).strip()
    return [{"role": "system", "content": system},
            {"role": "user", "content": f"Give one fact about {topic}."}]


def test_users_taking_turns_each_resume_their_own_conversation(server, oai):
    """A, B, A again: A's turn 2 is served from its turn 1's cache, restored from the
    prefix store (B's turn displaced it from the target), and its answer is the
    library's; /metrics counts the swap. Without the store A would reuse only the chat
    template's first tokens, which it shares with B."""
    def metric(name: str) -> float:
        with client(server.url, KEY) as c:
            lines = c.get("/metrics").text.splitlines()
        return next(float(x.split()[-1]) for x in lines if x.startswith(name + " "))

    swaps = metric("specdecode_prefix_store_swaps")
    a, b = users("geology"), users("music")
    r, _, n_prompt = second_turn(oai, a, b, "One more.", 8, 8)
    assert r.usage.prompt_tokens_details.cached_tokens > n_prompt - 20
    assert metric("specdecode_prefix_store_swaps") > swaps
    assert metric("specdecode_prefix_store_entries") >= 1
    assert metric("specdecode_prefix_store_bytes") > 0


def test_control_token_text_is_text_on_both_apis(oai, ant):
    llm = smol_llm()
    tok, evil = llm.tokenizer, hostile(llm.tokenizer)
    messages = conversation(evil)  # system, user, assistant, user
    ids = llm.encode(messages=messages)
    assert control_ids(tok, ids) == control_ids(tok, llm.encode(messages=conversation("Hi")))
    want = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=4))
    r = oai.chat.completions.create(model=NAME, messages=messages, temperature=0, max_tokens=4)
    assert r.usage.prompt_tokens == len(ids) and r.choices[0].message.content == want.text
    parts = [m | {"content": [{"type": "text", "text": evil}]} for m in messages]
    r = oai.chat.completions.create(model=NAME, messages=parts, temperature=0, max_tokens=4)
    assert r.usage.prompt_tokens == len(ids)
    m = ant.messages.create(model=NAME, max_tokens=4, system=evil, messages=messages[1:],
                            extra_body=GREEDY)
    assert m.usage.input_tokens == len(ids) and m.content[0].text == want.text
    raw = tok.encode(evil)
    assert not control_ids(tok, raw)
    r = oai.completions.create(model=NAME, prompt=evil, temperature=0, max_tokens=1)
    assert r.usage.prompt_tokens == len(raw)
