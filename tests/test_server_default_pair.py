"""Smoke test: `specdecode serve` on the default 1.5B + 0.5B pair (slow; pulls if missing)."""

from __future__ import annotations

import openai
import pytest

from server_util import ProcessServer

pytestmark = pytest.mark.slow


def test_default_pair_serves_with_speculation():
    with ProcessServer("--target", "default", "--max-context", "1024") as s:
        oai = openai.OpenAI(base_url=f"{s.url}/v1", api_key="none", max_retries=0, timeout=300)
        assert [m.id for m in oai.models.list().data] == ["qwen2.5-coder-1.5b"]
        messages = [{"role": "user", "content": "Write a Python function that adds two "
                                                "numbers."}]
        r = oai.chat.completions.create(model="default", messages=messages, temperature=0,
                                        max_tokens=32)
        spec = r.usage.model_extra["speculative"]
        assert r.choices[0].message.content and r.usage.completion_tokens > 0
        assert spec["drafter"] == "draft-model" and spec["drafted"] > 0
        assert spec["mean_accepted_length"] > 1
        stream = oai.chat.completions.create(model="default", messages=messages, temperature=0,
                                             max_tokens=32, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == (
            r.choices[0].message.content)
