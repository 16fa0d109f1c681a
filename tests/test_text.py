"""Output text and stop strings: linear work per step, same semantics as a whole-text search.

Work is counted, not timed: the token ids decoded (Detokenizer) and the
automaton steps (StopMatcher) must grow linearly with the output, whatever
its length and however long the stop strings are (within their limits).
"""

from __future__ import annotations

import pytest

import real
from specdecode.models import loading
from specdecode.text import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    StopMatcher,
    StopStrings,
    TextStream,
    check_stop_strings,
    find_stop,
)

TEXT = ("def greet(name):\n    return f'héllo {name} 中文 😀 🇫🇷 — ok'\n\n"
        "alpha beta gamma delta, alpha beta gamma delta; abcd bc abc\n") * 3
QWEN = pytest.param("qwen2.5-coder-0.5b", marks=pytest.mark.slow)


@pytest.fixture(scope="module", params=["smollm2-135m", QWEN])
def tok(request):
    return loading.load_tokenizer(real.path(request.param))


class Counting:
    """A tokenizer whose decode counts the token ids it was given."""

    def __init__(self, tok) -> None:
        self.tok, self.decoded = tok, 0

    def decode(self, ids) -> str:
        self.decoded += len(ids)
        return self.tok.decode(ids)


def reference(tok, ids: list[int], stops: tuple[str, ...]) -> tuple[int, str]:
    """Whole-text semantics: (tokens kept, text): stop at the first token whose decoded
    output holds a stop string; cut the text where the earliest one begins."""
    for n in range(1, len(ids) + 1):
        text = tok.decode(ids[:n])
        if (at := find_stop(text, stops)) >= 0:
            return n, text[:at]
    return len(ids), tok.decode(ids)


def run_stream(tokenizer, ids: list[int], stops: tuple[str, ...], step: int = 3):
    """Drive a TextStream as LLM.stream does: the hook per token, push per step."""
    stream, n, out = TextStream(tokenizer, stops), 0, ""
    while n < len(ids):
        new = []
        for t in ids[n:n + step]:
            new.append(t)
            if stops and stream.stop_hook(ids[:n + len(new)]):
                n += len(new)
                return n, out + stream.push(new) + stream.finish(), stream
        n += len(new)
        out += stream.push(new)
    return n, out + stream.finish(), stream


@pytest.mark.parametrize("stops", [("gamma",), ("abcd", "bc"), ("ta, al",), ("😀 🇫🇷",),
                                   ("ok'\n\nalpha",), ("never there",), ()])
def test_stream_and_hook_equal_whole_text_search_with_linear_work(tok, stops):
    ids = tok.encode(TEXT)
    counting = Counting(tok)
    n, text, stream = run_stream(counting, ids, stops)
    assert (n, text) == reference(tok, ids, stops)
    assert text == stream.text
    assert counting.decoded <= 8 * n  # the whole-output decode per token was ~n^2 / 2


def test_long_output_with_many_long_stops_is_linear(tok):
    ids = tok.encode(TEXT * 8)
    stops = tuple(c * (MAX_STOP_CHARS - 1) + "#" for c in "0123456789QXYZJK")
    counting = Counting(tok)
    hook = StopStrings(counting, stops)
    assert not any(hook(ids[:n]) for n in range(1, len(ids) + 1))
    chars = len(hook.stream.text)
    assert counting.decoded <= 6 * len(ids)
    assert hook.stream.matcher.steps <= 2 * len(stops) * chars


def test_matcher_on_adversarial_repeats_is_linear():
    stop = "a" * (MAX_STOP_CHARS - 1) + "b"
    matcher = StopMatcher([stop])
    for _ in range(5000):
        assert matcher.feed("aa") is None
    assert matcher.hold == MAX_STOP_CHARS - 1  # the tail that could still become the stop
    assert matcher.steps <= 2 * 10_000
    assert matcher.feed("b") == 10_000 - (MAX_STOP_CHARS - 1)  # where the stop begins


def test_earliest_stop_in_one_piece_wins():
    matcher = StopMatcher(["bcd", "abcde"])
    assert matcher.feed("xab") is None
    assert matcher.feed("cdef") == 1  # both complete in this piece: the earlier start


def test_replacement_character_stop_waits_for_whole_characters(tok):
    ids = tok.encode("rare: 𝔘𝔫𝔦 ꙮ 𓀀 done")
    assert "\ufffd" in "".join(tok.decode([t]) for t in ids)  # characters span tokens
    n, text, _ = run_stream(tok, ids, ("\ufffd",), step=1)
    assert (n, text) == (len(ids), tok.decode(ids))


def test_stop_string_limits():
    check_stop_strings(["x" * MAX_STOP_CHARS] * MAX_STOP_STRINGS)
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_STRINGS}"):
        check_stop_strings(["x"] * (MAX_STOP_STRINGS + 1))
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_CHARS} characters"):
        check_stop_strings(["x" * (MAX_STOP_CHARS + 1)])
    with pytest.raises(ValueError, match="non-empty"):
        TextStream(None, [""])
