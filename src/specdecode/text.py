"""Text around the engine: tokenizer + chat template, stop strings, streamed deltas.

The engine works in token ids. This module turns text and chat messages into
ids (through the model's own tokenizer and chat template, via transformers),
turns ids back into text, and implements stop strings the way plain decoding
does: generation stops at the token that completes a stop string (even inside
an accepted draft), and the text is cut where the stop string begins (the
stop string itself is not returned, as in the OpenAI API).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


class Tokenizer:
    """A model's tokenizer and chat template (a transformers tokenizer inside)."""

    def __init__(self, hf_tokenizer) -> None:
        self.hf = hf_tokenizer

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        from transformers import AutoTokenizer

        path = Path(path)
        _quiet_transformers()
        return cls(AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name))

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        from transformers import AutoTokenizer

        _quiet_transformers()
        return cls(AutoTokenizer.from_pretrained(str(folder)))

    def save(self, folder: str | Path) -> None:
        self.hf.save_pretrained(str(folder))

    @property
    def vocab_size(self) -> int:
        """Number of real tokens (embedding tables may be padded beyond this)."""
        return len(self.hf)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.hf.eos_token_id
        return () if eos is None else (int(eos),)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        """A raw prompt, with the model's own BOS convention."""
        return list(self.hf.encode(text, add_special_tokens=True))

    def chat(self, messages: Sequence[dict]) -> list[int]:
        """A conversation through the chat template, ready for the assistant's turn."""
        if not self.has_chat_template:
            raise ValueError("this model has no chat template; give a raw prompt instead")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"message {i} must be an object with 'role' and 'content'")
        text = self.hf.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=True)
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True)


def _quiet_transformers() -> None:
    from transformers.utils import logging

    logging.set_verbosity_error()


def find_stop(text: str, stops: Sequence[str], start: int = 0) -> int:
    """Index where the earliest stop string begins in text[start:] (-1 if none)."""
    hits = [i for s in stops if (i := text.find(s, start)) >= 0]
    return min(hits) if hits else -1


class StopStrings:
    """Engine stop hook: True at the token whose text completes a stop string."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str]) -> None:
        self.tokenizer, self.stops = tokenizer, tuple(stops)
        self.longest = max((len(s) for s in self.stops), default=0)
        self._checked = 0  # characters of output already searched

    def __call__(self, output_ids: list[int]) -> bool:
        text = self.tokenizer.decode(output_ids)
        hit = find_stop(text, self.stops, max(0, self._checked - self.longest))
        self._checked = len(text)
        return hit >= 0


class TextStream:
    """Growing token ids -> text deltas that are safe to show.

    Holds back an incomplete UTF-8 character and any tail that could still
    become a stop string; `finish()` releases the rest, cut at a stop string.
    """

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str] = ()) -> None:
        self.tokenizer, self.stops = tokenizer, tuple(stops)
        self.ids: list[int] = []
        self.sent = 0

    def _cut(self, text: str) -> str:
        i = find_stop(text, self.stops)
        return text if i < 0 else text[:i]

    def push(self, new_ids: Sequence[int]) -> str:
        self.ids += new_ids
        text = self._cut(self.tokenizer.decode(self.ids)).rstrip("\ufffd")
        hold = max((n for s in self.stops for n in range(1, len(s))
                    if text.endswith(s[:n])), default=0)
        return self._emit(text[: len(text) - hold])

    def finish(self) -> str:
        return self._emit(self.text)

    @property
    def text(self) -> str:
        """The whole output text, cut at a stop string."""
        return self._cut(self.tokenizer.decode(self.ids))

    def _emit(self, safe: str) -> str:
        delta = safe[self.sent:] if len(safe) > self.sent else ""
        self.sent = max(self.sent, len(safe))
        return delta
