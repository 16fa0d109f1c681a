"""Suffix drafter: the most frequent continuation of the context's longest repeated
suffix, in this request's text and in earlier requests' (suffix decoding's idea).

Where the n-gram drafter copies what followed the most recent occurrence of the
last few tokens, this one gathers every occurrence (up to MAX_OCCURRENCES, the
most recent) of the longest suffix of the context seen before: in the request's
prompt + output (live) and in a bounded store of earlier requests' prompts +
outputs (`SuffixStore`, shared by every request of a process or server). It then
walks their continuations token by token, keeping the most frequent next token
while its share of the occurrences still following is at least min_token_prob,
for at most max_spec_factor x the match length tokens. No model, no
probabilities: the draft is a point mass per token, which the verifier handles
exactly (as for n-gram lookup), so the target's output does not change.

Matches: the live text is indexed by n-grams of min_n..max_n tokens, the store
by STORE_N-grams only (memory); a match found by its last n tokens is then
extended backwards, token by token, up to MAX_MATCH, and only the occurrences
of the longest match are followed. Draft.kind is the match length, capped at
KINDS, as for the n-gram drafter (the controller's estimates are per kind).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence

import torch

from specdecode.drafters.base import MATCH_PRIORS, BaseDrafter, Draft, DraftContext
from specdecode.sampling import SamplingParams

MAX_OCCURRENCES = 32  # occurrences of an n-gram remembered (the most recent)
MAX_MATCH = 64  # a match is extended backwards up to this many tokens
STORE_N = 4  # the store indexes n-grams of this length
STORE_MIN_MATCH = 16  # the store's drafts only after a match this long (and longer than live)

Occurrence = tuple[Sequence[int], int]  # (the text, the position after the match)


def _remember(index: dict[tuple[int, ...], list], key: tuple[int, ...], item) -> None:
    slot = index.get(key)
    if slot is None:
        index[key] = [item]
        return
    slot.append(item)
    if len(slot) > MAX_OCCURRENCES:
        del slot[0]


class SuffixStore:
    """Earlier requests' texts (token ids), indexed by their STORE_N-grams; at most
    max_tokens tokens: adding past it evicts the oldest texts first. A text that
    extends the last one added (a conversation's next turn: it resends the last
    prompt and its answer) replaces it, so a turn is not counted twice.

    Dropped texts leave the index lazily (their occurrences are skipped, and the
    index is rebuilt once they are a quarter of it). Shared by the requests of a
    process (a server's, a CLI run's); `stats()` says what it holds and roughly
    what it costs in memory."""

    def __init__(self, max_tokens: int = 200_000) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self.clear()

    def clear(self) -> None:
        """Forget every text."""
        self._texts: deque[tuple[int, tuple[int, ...]]] = deque()  # (number, text)
        self._index: dict[tuple[int, ...], list] = {}  # gram -> [(number, text, after)]
        self._first = self._next = 0  # texts numbered below _first were dropped
        self._replaced: set[int] = set()
        self.tokens = self.evicted = self._dead = self.entries = 0

    def add(self, ids: Sequence[int]) -> None:
        """Keep one more text (longer than max_tokens: its last max_tokens tokens)."""
        text = tuple(ids[-self.max_tokens:]) if self.max_tokens else ()
        if len(text) <= STORE_N:
            return
        if self._texts and text[:len(self._texts[-1][1])] == self._texts[-1][1]:
            number, old = self._texts.pop()  # the same conversation, one turn on
            self._replaced.add(number)
            self.tokens -= len(old)
            self._dead += len(old)
        self._texts.append((self._next, text))
        self._next += 1
        self.tokens += len(text)
        while self.tokens > self.max_tokens:
            number, old = self._texts.popleft()
            self._first = number + 1
            self.tokens -= len(old)
            self._dead += len(old)
            self.evicted += 1
        if self._dead > max(self.tokens, 1) // 3:
            self._rebuild()
        else:
            self._index_text(*self._texts[-1])

    def _index_text(self, number: int, text: tuple[int, ...]) -> None:
        for end in range(STORE_N, len(text)):  # n-grams that have a next token
            _remember(self._index, text[end - STORE_N:end], (number, text, end))
        self.entries += len(text) - STORE_N

    def _rebuild(self) -> None:
        self._index, self._dead, self.entries, self._replaced = {}, 0, 0, set()
        for number, text in self._texts:
            self._index_text(number, text)

    def _alive(self, number: int) -> bool:
        return number >= self._first and number not in self._replaced

    def occurrences(self, gram: tuple[int, ...]) -> list[Occurrence]:
        """Where the STORE_N-gram `gram` occurs, as (text, position after it)."""
        return [(text, after) for number, text, after in self._index.get(gram, ())
                if self._alive(number)]

    def stats(self) -> dict[str, int]:
        """texts, tokens, evicted, and an estimate of the bytes held: each text's ids
        (8 B each), each indexed n-gram (tuple, list and dict slot, ~180 B) and
        occurrence (tuple, ~80 B). No lock is taken: read from any thread."""
        return {"texts": len(self._texts), "tokens": self.tokens, "evicted": self.evicted,
                "bytes": 8 * (self.tokens + self._dead) + 180 * len(self._index)
                + 80 * self.entries}


class SuffixDrafter(BaseDrafter):
    """Proposes the most frequent continuation of the longest repeated suffix (module
    docstring). store: earlier requests' texts (None: this request's text only); each
    request's prompt + output is added to it when the request finishes."""

    name = "suffix"
    KINDS = 4
    kind_priors = MATCH_PRIORS  # each kind's starting acceptance (drafters/base.py)

    def __init__(self, store: SuffixStore | None = None, *, max_n: int = 8, min_n: int = 1,
                 min_token_prob: float = 0.1, max_spec_factor: float = 8.0) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if not 0.0 <= min_token_prob <= 1.0 or max_spec_factor <= 0:
            raise ValueError("need 0 <= min_token_prob <= 1 and max_spec_factor > 0")
        self.store, self.max_n, self.min_n = store, max_n, min_n
        self.min_token_prob, self.max_spec_factor = min_token_prob, max_spec_factor
        self._ids: list[int] = []
        self._index: dict[tuple[int, ...], list] = {}  # n-gram -> positions after it
        self._prompt: list[int] = []
        self.match_n = 0  # length of the last proposal's match (0: none)

    def begin(self, prompt_ids: list[int], params: SamplingParams,
              generator: torch.Generator) -> None:
        self._ids, self._index, self._prompt = [], {}, list(prompt_ids)

    def finish(self, output_ids: list[int]) -> None:
        """The request's prompt + output go to the store. (The prompt is the one the
        last `begin` saw: requests interleaved on one drafter would pair them wrong;
        the server and CLI run one request at a time.)"""
        if self.store is not None and self._prompt:
            self.store.add(self._prompt + list(output_ids))
        self._prompt = []

    def _extend(self, context: list[int]) -> None:
        """Index the n-grams of context that have a next token (a context that does not
        extend the indexed one is indexed anew)."""
        old = len(self._ids)
        if len(context) < old or context[:old] != self._ids:
            self._ids, self._index, old = [], {}, 0
        self._ids = list(context)
        for after in range(max(1, old), len(context)):  # n-grams ending before `after`
            for n in range(self.min_n, min(self.max_n, after) + 1):
                _remember(self._index, tuple(context[after - n:after]), after)

    def _matches(self, context: list[int]) -> tuple[int, list[Occurrence]]:
        """(match length, occurrences of the longest match): this request's own text
        first; the store's only where it matches at least STORE_MIN_MATCH tokens and
        longer than the request's own text (replayed on recorded HumanEval answers,
        each with the earlier ones in the store: store matches of any length gave
        1.70x, none 1.90x: other answers' short matches, such as the code-block
        opening, continue differently)."""
        live: list[Occurrence] = []
        for n in range(min(self.max_n, len(context) - 1), self.min_n - 1, -1):
            positions = self._index.get(tuple(context[-n:]))
            if positions:
                live = [(self._ids, p) for p in positions]
                break
        best, chosen = self._longest(context, live)
        if self.store is not None and len(context) >= STORE_N:
            stored, found = self._longest(context, self.store.occurrences(
                tuple(context[-STORE_N:])))
            if stored > best and stored >= STORE_MIN_MATCH:
                best, chosen = stored, found
        return best, chosen

    def _longest(self, context: list[int], found: list[Occurrence]
                 ) -> tuple[int, list[Occurrence]]:
        if not found:
            return 0, []
        lengths = [self._match_length(context, text, after) for text, after in found]
        best = max(lengths)
        return best, [o for o, n in zip(found, lengths) if n == best]

    @staticmethod
    def _match_length(context: list[int], text: Sequence[int], after: int) -> int:
        n = 0
        most = min(MAX_MATCH, after, len(context) - 1)
        while n < most and text[after - 1 - n] == context[-1 - n]:
            n += 1
        return n

    def propose(self, ctx: DraftContext) -> Draft:
        context, k = ctx.tokens, ctx.k
        self._extend(context)
        self.match_n = 0
        if k <= 0 or len(context) < 2:
            return Draft.empty()
        match, alive = self._matches(context)
        if not alive:
            return Draft.empty()
        self.match_n = match
        limit = min(k, max(1, int(self.max_spec_factor * match)))
        tokens = self._walk(alive, limit)
        if not tokens:
            return Draft.empty()
        return Draft(torch.tensor(tokens, dtype=torch.long), kind=min(match, self.KINDS))

    def _walk(self, alive: list[Occurrence], limit: int) -> list[int]:
        """Follow the occurrences' continuations: the most frequent next token while
        its share of those still following is >= min_token_prob."""
        tokens: list[int] = []
        for depth in range(limit):
            nexts = [(o, o[0][o[1] + depth]) for o in alive if o[1] + depth < len(o[0])]
            if not nexts:
                break
            token, count = Counter(t for _, t in nexts).most_common(1)[0]
            if count / len(nexts) < self.min_token_prob:
                break
            tokens.append(token)
            alive = [o for o, t in nexts if t == token]
        return tokens
