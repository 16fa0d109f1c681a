"""Text around the engine: tokenizer + chat template, stop strings, streamed deltas.

The engine works in token ids. This module turns text and chat messages into
ids (through the model's own tokenizer and chat template, via transformers),
turns ids back into text, and implements stop strings the way plain decoding
does: generation stops at the token that completes a stop string (even inside
an accepted draft), and the text is cut where the stop string begins (the
stop string itself is not returned, as in the OpenAI API).

User text is data. Message content and raw prompts are tokenized as literal
text: `<|im_end|>` typed by a user becomes the characters `<`, `|`, ..., never
the control token; only the chat template's own markup yields control tokens.

Output text is built incrementally (`Detokenizer`: each step decodes a window of
a few tokens) and stop strings are matched by one automaton per string fed only
the new characters (`StopMatcher`), so the work per step is linear in the new
text whatever the output's length; a stop string may have at most
MAX_STOP_CHARS characters and a request at most MAX_STOP_STRINGS of them.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
from collections.abc import Sequence
from pathlib import Path

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024


def check_stop_strings(stops: Sequence[str]) -> None:
    """ValueError (message starting with "stop") unless `stops` are at most
    MAX_STOP_STRINGS non-empty strings of at most MAX_STOP_CHARS characters."""
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"stop strings: at most {MAX_STOP_STRINGS} are allowed, "
                         f"got {len(stops)}")
    for s in stops:
        if not isinstance(s, str) or not s:
            raise ValueError("stop strings must be non-empty strings")
        if len(s) > MAX_STOP_CHARS:
            raise ValueError(f"stop strings may have at most {MAX_STOP_CHARS} characters, "
                             f"got one of {len(s)}")


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

    @functools.cached_property
    def control_tokens(self) -> frozenset[str]:
        """Texts of the control tokens: every special added token, and the other added
        tokens the chat template writes (Qwen's `<tool_call>`). User text never yields them."""
        template = str(getattr(self.hf, "chat_template", None) or "")
        return frozenset(str(t.content) for t in self.hf.added_tokens_decoder.values()
                         if t.content and (t.special or str(t.content) in template))

    @functools.cached_property
    def _literal(self):
        """A copy of the fast tokenizer that matches no control token in its input
        (its own object: the shared one's `encode_special_tokens` flag is per call)."""
        from tokenizers import Tokenizer as FastTokenizer

        if not hasattr(self.hf, "_tokenizer"):
            return None  # not a fast tokenizer: transformers' split_special_tokens instead
        spec = json.loads(self.hf._tokenizer.to_str())
        for token in spec.get("added_tokens", []):
            if token["content"] in self.control_tokens:
                token["special"] = True
        literal = FastTokenizer.from_str(json.dumps(spec))
        literal.encode_special_tokens = True
        literal.no_truncation()
        literal.no_padding()
        return literal

    def encode(self, text: str, special: bool = False) -> list[int]:
        """A raw prompt, with the model's own BOS convention. The text is literal:
        control-token text in it stays text, unless `special` (trusted input only)."""
        if special or not self.control_tokens:
            return list(self.hf.encode(text, add_special_tokens=True))
        if self._literal is None:
            return list(self.hf.encode(text, add_special_tokens=True, split_special_tokens=True))
        return self._literal.encode(text, add_special_tokens=True).ids

    def _literal_pieces(self, texts: Sequence[str]) -> list[list[int]]:
        if self._literal is None:
            return [list(self.hf.encode(t, add_special_tokens=False, split_special_tokens=True))
                    for t in texts]
        return [e.ids for e in self._literal.encode_batch(list(texts), add_special_tokens=False)]

    def chat(self, messages: Sequence[dict]) -> list[int]:
        """A conversation through the chat template, ready for the assistant's turn.

        Each message is {role, content}: a role of ROLES ("developer" read as
        "system"), content a string or a list of text parts ({"type": "text",
        "text": ...}, joined); other keys are dropped (a tool call's name, say,
        is text the template would splice in unescaped), other roles are a
        ValueError. Content is tokenized as literal text; only the template's
        markup produces control tokens. A conversation without control-token text gets
        exactly the ids of the plain template rendering. A template that raises
        (roles it refuses, say) is a ValueError."""
        if not self.has_chat_template:
            raise ValueError("this model has no chat template; give a raw prompt instead")
        messages = [chat_message(m, i) for i, m in enumerate(messages)]
        escape = _Escape(self.control_tokens, [m["content"] for m in messages])
        escaped = [m | {"content": escape(m["content"])} for m in messages]
        try:
            text = self.hf.apply_chat_template(escaped, tokenize=False,
                                               add_generation_prompt=True)
        except Exception as e:  # the template's own checks (roles, order) or its errors
            raise TemplateRefused(f"the chat template refused these messages: {e}") from None
        markup, literal = escape.split(text)
        if not literal:
            return list(self.hf.encode(text, add_special_tokens=False))
        markup_ids = self.hf(markup, add_special_tokens=False)["input_ids"]
        literal_ids = self._literal_pieces(literal)
        ids = list(markup_ids[0])
        for lit, mark in zip(literal_ids, markup_ids[1:], strict=True):
            ids += lit + list(mark)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True)


ROLES = ("system", "developer", "user", "assistant")  # as the server's chat route


class TemplateRefused(ValueError):
    """The chat template raised on these messages (its message says why)."""


def chat_message(m: object, i: int) -> dict:
    """{role, content} of message i: role a string of ROLES ("developer" read as
    "system"), content a string or a list of text parts (joined); other keys dropped.
    A malformed message is a ValueError naming it (and the part)."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
        raise ValueError(f"message {i} must be an object with a string 'role' and a 'content'")
    if m["role"] not in ROLES:
        raise ValueError(f"message {i} has role {m['role'][:40]!r}; the roles are "
                         f"{', '.join(ROLES)}")
    content = m["content"]
    if isinstance(content, list):
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise ValueError(f"message {i} content part {j}: only text parts "
                                 "({\"type\": \"text\", \"text\": ...}) are supported")
        content = "".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise ValueError(f"message {i} content must be a string or a list of text parts, "
                         f"got {type(content).__name__}")
    return {"role": "system" if m["role"] == "developer" else m["role"], "content": content}


class _Escape:
    """Marks control-token text inside message content for `Tokenizer.chat`.

    Each occurrence is wrapped in two markers (private-use characters around a
    random nonce no content contains); after the template is rendered, `split`
    cuts the text at the markers: the wrapped pieces are tokenized as literal
    text, everything else (markup and ordinary content) as the template intends."""

    def __init__(self, control: frozenset[str], contents: Sequence[str]) -> None:
        while True:
            nonce = secrets.token_hex(8)
            self.open, self.close = f"\ue000{nonce}\ue001", f"\ue002{nonce}\ue003"
            if not any(nonce in c for c in contents):
                break
        self.control = control
        by_length = sorted(control, key=len, reverse=True)
        self.pattern = re.compile("|".join(map(re.escape, by_length))) if control else None

    def __call__(self, content: str) -> str:
        if self.pattern is None:
            return content
        return self.pattern.sub(lambda m: f"{self.open}{m.group(0)}{self.close}", content)

    def split(self, text: str) -> tuple[list[str], list[str]]:
        """(markup pieces, literal pieces between them): len(markup) == len(literal) + 1."""
        first, *rest = text.split(self.open)
        markup, literal = [first], []
        for part in rest:
            pieces = part.split(self.close)
            if len(pieces) != 2 or pieces[0] not in self.control:
                raise ValueError("the chat template rewrote message content it was given")
            literal.append(pieces[0])
            markup.append(pieces[1])
        if any(self.close in m for m in markup):
            raise ValueError("the chat template rewrote message content it was given")
        return markup, literal


def _quiet_transformers() -> None:
    from transformers.utils import logging

    logging.set_verbosity_error()


def find_stop(text: str, stops: Sequence[str], start: int = 0) -> int:
    """Index where the earliest stop string begins in text[start:] (-1 if none)."""
    hits = [i for s in stops if (i := text.find(s, start)) >= 0]
    return min(hits) if hits else -1


class Detokenizer:
    """Growing token ids -> final text, a few tokens' decode per step.

    Each `push` decodes only the tokens since the previous commit plus those
    still pending, and commits text up to the last of the newest few token
    boundaries that ends a whole character (the decode does not end in
    U+FFFD). A partial character is therefore never part of the text, unless
    MAX_PENDING tokens in a row end none (a model emitting invalid bytes):
    then they are committed as U+FFFD, as a whole decode shows them. The
    committed pieces join to `Tokenizer.decode` of all ids (for decoders that
    concatenate, as byte-level BPE and SentencePiece do). `decoded` counts
    the token ids decoded so far (the work done).
    """

    MAX_PENDING = 16
    LOOK_BACK = 3  # a partial UTF-8 character has at most 3 bytes: in the last 3 tokens

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = self._read = 0  # ids[prefix:read]: last commit; ids[read:]: pending
        self.decoded = 0

    def _decode(self, end: int) -> str:
        self.decoded += end - self._prefix
        return self.tokenizer.decode(self.ids[self._prefix:end])

    def push(self, new_ids: Sequence[int]) -> str:
        """Add ids; return the newly committed text ("" while a character is incomplete)."""
        self.ids += new_ids
        if self._read == len(self.ids):
            return ""
        end = len(self.ids)
        for j in range(end, max(self._read, end - self.LOOK_BACK - 1), -1):
            text = self._decode(j)
            if not text.endswith("\ufffd"):
                return self._commit(j, text)
        if end - self._read >= self.MAX_PENDING:
            return self.flush()
        return ""

    def flush(self) -> str:
        """At the end: commit whatever is pending, an incomplete character as U+FFFD."""
        if self._read == len(self.ids):
            return ""
        text = self._commit(len(self.ids), self._decode(len(self.ids)))
        self._prefix = self._read  # start afresh: nothing before can complete a character
        return text

    def _commit(self, end: int, text: str) -> str:
        head = self._decode(self._read) if self._read > self._prefix else ""
        self._prefix, self._read = self._read, end
        return text[len(head):]


def _failure(s: str) -> list[int]:
    """KMP failure function: f[i] = length of the longest proper border of s[:i + 1]."""
    f, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = f[k - 1]
        if s[i] == s[k]:
            k += 1
        f[i] = k
    return f


class StopMatcher:
    """Stop strings found in text fed piece by piece: one automaton per string.

    `feed(piece)` costs O(len(piece)) amortized per stop string, whatever was
    fed before; `hold` is the longest tail of the text that could still grow
    into a stop string (held back from streaming). `steps` counts automaton
    transitions (the work done)."""

    def __init__(self, stops: Sequence[str]) -> None:
        check_stop_strings(stops)
        self.stops = tuple(stops)
        self._fail = [_failure(s) for s in self.stops]
        self._state = [0] * len(self.stops)
        self.fed = 0  # characters fed
        self.steps = 0

    @property
    def hold(self) -> int:
        return max(self._state, default=0)

    def feed(self, piece: str) -> int | None:
        """Feed text; the index (in all text fed) where the earliest stop string begins
        among those that first complete in `piece`, or None."""
        best = None
        for j in range(len(self.stops)):
            start = self._run(j, piece)
            if start is not None:
                best = start if best is None else min(best, start)
        self.fed += len(piece)
        return best

    def _run(self, j: int, piece: str) -> int | None:
        s, fail, q, steps = self.stops[j], self._fail[j], self._state[j], 0
        hit = None
        for i, ch in enumerate(piece):
            while q and s[q] != ch:
                q, steps = fail[q - 1], steps + 1
            steps += 1
            if s[q] == ch:
                q += 1
                if q == len(s):
                    hit, q = self.fed + i + 1 - len(s), fail[q - 1]
                    break
        self._state[j], self.steps = q, self.steps + steps
        return hit


class TextStream:
    """Growing token ids -> text deltas that are safe to show, and the stop-string hook.

    Holds back an incomplete UTF-8 character and any tail that could still
    become a stop string; `finish()` releases the rest, cut at a stop string.
    `stop_hook` is the engine's stop hook over the same text (one decode for
    both); `push` takes each step's ids, whether or not the hook saw them.
    """

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str] = ()) -> None:
        self.detok = Detokenizer(tokenizer)
        self.matcher = StopMatcher(stops)
        self.stops = self.matcher.stops
        self.cut: int | None = None  # where a stop string begins, once one is found
        self._parts: list[str] = []  # committed text
        self._pushed = 0  # ids given to push
        self._unsent = ""  # committed text from `sent` on
        self.sent = 0

    def _take(self, new_ids: Sequence[int]) -> None:
        if self.cut is None:
            self._add(self.detok.push(new_ids))
        else:
            self.detok.ids += new_ids

    def _add(self, piece: str) -> None:
        if piece:
            self.cut = self.matcher.feed(piece)
            self._parts.append(piece)
            self._unsent += piece

    def stop_hook(self, output_ids: Sequence[int]) -> bool:
        """True once the output's text holds a stop string (output_ids: all ids so far)."""
        self._take(output_ids[len(self.detok.ids):])
        return self.cut is not None

    def push(self, new_ids: Sequence[int]) -> str:
        self._pushed += len(new_ids)
        missing = self._pushed - len(self.detok.ids)
        if missing > 0:
            self._take(list(new_ids)[len(new_ids) - missing:])
        end = self.cut if self.cut is not None else self.matcher.fed - self.matcher.hold
        return self._emit(end)

    def finish(self) -> str:
        if self.cut is None:
            self._add(self.detok.flush())
        return self._emit(self.cut if self.cut is not None else self.matcher.fed)

    @property
    def text(self) -> str:
        """The whole output text so far, cut at a stop string."""
        text = "".join(self._parts)
        return text if self.cut is None else text[:self.cut]

    def _emit(self, end: int) -> str:
        if end <= self.sent:
            return ""
        delta, self._unsent = self._unsent[:end - self.sent], self._unsent[end - self.sent:]
        self.sent = end
        return delta


class StopStrings:
    """Engine stop hook on its own: True at the token whose text completes a stop string."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str]) -> None:
        self.stream = TextStream(tokenizer, stops)
        self.stops = self.stream.stops

    def __call__(self, output_ids: list[int]) -> bool:
        return self.stream.stop_hook(output_ids)
