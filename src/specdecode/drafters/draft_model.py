"""Draft-model drafter: a smaller CausalLM of the same vocabulary proposes k tokens.

Drafts are sampled from q = logits_to_probs(draft logits) with the request's
own temperature / top-k / top-p / min-p (argmax when greedy), and q is
returned so the verifier can run exact rejection sampling. The draft model's
KV cache is kept equal to the accepted prefix: before each proposal the
drafter rolls back to the longest common prefix of what it has cached and the
context, then feeds the rest (usually 1-2 tokens).
"""

from __future__ import annotations

import time

import torch

from specdecode.drafters.base import BaseDrafter, Draft, DraftContext
from specdecode.models.base import CausalLM
from specdecode.sampling import SamplingParams, logits_to_probs, sample


class VocabularyMismatch(ValueError):
    """The draft model and the target do not share a vocabulary."""


class DraftModelDrafter(BaseDrafter):
    name = "draft-model"

    def __init__(
        self,
        draft: CausalLM,
        target: CausalLM,
        *,
        shared_vocab_size: int | None = None,
        confidence_threshold: float = 0.0,
    ) -> None:
        """`shared_vocab_size`: the real vocabulary both models use, when their
        embedding tables differ only by padding (checked by the caller against
        the tokenizers). Without it the table sizes must be equal.

        `confidence_threshold`: stop drafting early after a token the draft
        model itself gave less than this probability (0 = always draft k).
        """
        if shared_vocab_size is None:
            if draft.vocab_size != target.vocab_size:
                raise VocabularyMismatch(
                    f"draft model vocabulary ({draft.vocab_size} tokens) differs from the "
                    f"target's ({target.vocab_size} tokens)")
            shared_vocab_size = target.vocab_size
        elif shared_vocab_size > min(draft.vocab_size, target.vocab_size):
            raise VocabularyMismatch(
                f"shared vocabulary of {shared_vocab_size} tokens does not fit the draft "
                f"({draft.vocab_size}) and target ({target.vocab_size}) tables")
        self.draft_model = self.model = draft  # (model: the older name)
        self.confidence_threshold = confidence_threshold
        self.target_vocab_size = target.vocab_size
        self.shared_vocab_size = shared_vocab_size
        self._cached: list[int] = []  # token ids whose KV is in the draft cache
        # The last proposal's cost: (tokens fed before the first draft token, seconds of
        # that forward, one-token forwards after it, their seconds): the controller's
        # observation of what drafting and catching up cost (controller.py).
        self.timing: tuple[int, float, int, float] = (0, 0.0, 0, 0.0)

    def pending(self, context: list[int]) -> int:
        """Tokens the next proposal after `context` feeds before its first draft token
        (1-2 when it drafted the step before; the whole gap after a pause)."""
        limit = min(len(self._cached), self.model.cached_len, len(context) - 1)
        common = limit
        if self._cached[:limit] != context[:limit]:
            common = next(i for i in range(limit) if self._cached[i] != context[i])
        return len(context) - common

    def _sync(self, context: list[int]) -> list[int]:
        """Roll the draft cache back to its common prefix with context; return the rest."""
        common = len(context) - self.pending(context)
        self.model.rollback(common)
        del self._cached[common:]
        return context[common:]

    def propose(self, ctx: DraftContext) -> Draft:
        """Sample (argmax when greedy) up to ctx.k tokens with the request's params;
        the cache keeps a shared prefix with the previous request (reused)."""
        context, params = ctx.tokens, ctx.params
        room = self.model.max_seq_len - len(context) + 1
        k = min(ctx.k, room)
        if k <= 0:
            return Draft.empty()
        start = time.perf_counter()
        feed = self._sync(context)
        logits = self.model.forward(
            torch.tensor(feed, dtype=torch.long), last_n=1).logits  # [1, vocab]
        self._cached.extend(feed)
        first = time.perf_counter()
        tokens: list[int] = []
        q_rows: list[torch.Tensor] = []
        for i in range(k):
            if params.greedy:
                row = logits[0, : self.shared_vocab_size]
                token = int(row.argmax())
                if self.confidence_threshold > 0:
                    confidence = float(row.softmax(-1)[token])
            else:
                q_i = self._probs(logits[0], params)  # [target_vocab]
                token = sample(q_i, ctx.generator)
                q_rows.append(q_i)
                confidence = float(q_i[token])
            tokens.append(token)
            if self.confidence_threshold > 0 and confidence < self.confidence_threshold:
                break
            if i < k - 1:
                logits = self.model.forward(
                    torch.tensor([token], dtype=torch.long), last_n=1).logits
                self._cached.append(token)
        q = None if params.greedy else torch.stack(q_rows)  # [k, target_vocab]
        self.timing = (len(feed), first - start, len(tokens) - 1, time.perf_counter() - first)
        return Draft(torch.tensor(tokens, dtype=torch.long), q)

    def _probs(self, logits: torch.Tensor,  # [draft_vocab] -> [target_vocab]
               params: SamplingParams) -> torch.Tensor:
        q = logits_to_probs(logits[: self.shared_vocab_size], params)
        if self.shared_vocab_size < self.target_vocab_size:
            q = torch.nn.functional.pad(q, (0, self.target_vocab_size - self.shared_vocab_size))
        return q
