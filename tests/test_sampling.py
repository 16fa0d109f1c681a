"""logits_to_probs: temperature, top_k, top_p, min_p, greedy; parameter checks."""

from __future__ import annotations

import math

import pytest
import torch

from specdecode.sampling import SamplingParams, logits_to_probs

LOGITS = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))


def approx(t: torch.Tensor, values: list[float]) -> None:
    torch.testing.assert_close(t, torch.tensor(values, dtype=torch.float32), atol=1e-6, rtol=1e-5)


def test_temperature_one_is_softmax():
    approx(logits_to_probs(LOGITS, SamplingParams(temperature=1.0)), [0.5, 0.25, 0.15, 0.1])


def test_greedy_is_one_hot_on_first_argmax():
    approx(logits_to_probs(torch.tensor([1.0, 3.0, 3.0]), SamplingParams()), [0, 1, 0])


def test_temperature_sharpens():
    p = logits_to_probs(LOGITS, SamplingParams(temperature=0.5))
    want = torch.tensor([0.5, 0.25, 0.15, 0.1]) ** 2
    approx(p, (want / want.sum()).tolist())


def test_top_k():
    approx(logits_to_probs(LOGITS, SamplingParams(temperature=1.0, top_k=2)), [2 / 3, 1 / 3, 0, 0])


def test_top_p_keeps_the_token_that_crosses_the_threshold():
    # cumulative: 0.5, 0.75, 0.9, 1.0; top_p = 0.7 keeps {0.5, 0.25}
    approx(logits_to_probs(LOGITS, SamplingParams(temperature=1.0, top_p=0.7)),
           [2 / 3, 1 / 3, 0, 0])
    # exactly reaching top_p stops there
    approx(logits_to_probs(LOGITS, SamplingParams(temperature=1.0, top_p=0.75)),
           [2 / 3, 1 / 3, 0, 0])
    p = logits_to_probs(LOGITS, SamplingParams(temperature=1.0, top_p=0.76))
    approx(p, [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0])


def test_min_p():
    # threshold 0.4 * 0.5 = 0.2 drops 0.15 and 0.1
    approx(logits_to_probs(LOGITS, SamplingParams(temperature=1.0, min_p=0.4)),
           [2 / 3, 1 / 3, 0, 0])


def test_batched_rows_are_independent():
    rows = torch.stack((LOGITS, LOGITS.flip(0)))
    p = logits_to_probs(rows, SamplingParams(temperature=1.0, top_k=1))
    approx(p[0], [1, 0, 0, 0])
    approx(p[1], [0, 0, 0, 1])


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.1}, "temperature must be >= 0"),
    ({"temperature": math.nan}, "temperature must be >= 0"),
    ({"temperature": "hot"}, "temperature must be a number"),
    ({"top_k": -1}, "top_k must be an integer >= 0"),
    ({"top_k": 2.5}, "top_k must be an integer"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"min_p": -0.5}, r"min_p must be in \[0, 1\]"),
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ({"max_tokens": True}, "max_tokens must be an integer >= 1"),
    ({"stop_token_ids": (-1,)}, "stop_token_ids"),
    ({"stop": ("",)}, "stop strings"),
])
def test_bad_parameters_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_extreme_values_stay_finite():
    tiny_t = logits_to_probs(LOGITS, SamplingParams(temperature=1e-300))
    approx(tiny_t, [1, 0, 0, 0])  # below 1e-5 is greedy
    tiny_p = logits_to_probs(LOGITS, SamplingParams(temperature=1.0, top_p=1e-300))
    approx(tiny_p, [1, 0, 0, 0])  # the top token always survives top_p


def test_one_stop_string_is_a_stop_string_not_its_characters():
    """As the OpenAI API reads `stop`: "xe" once stopped generation at any "x" or "e"."""
    assert SamplingParams(stop="xe").stop == ("xe",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    hash(SamplingParams(stop=["a"]))  # frozen and hashable, as its fields say
    with pytest.raises(ValueError, match="non-empty strings"):
        SamplingParams(stop="")
