"""What both APIs share: the served model, prompt checks, sampling, jobs, results, stats.

Routes turn their request into prompt ids and SamplingParams here, get a 4xx
for anything the engine would refuse (unknown model, empty or too-long
prompt, out-of-range values) before a job is queued, and read the job back
as a whole `Completion` or as chunks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict

from specdecode.llm import LLM
from specdecode.sampling import SamplingParams
from specdecode.server.errors import APIError, shorten
from specdecode.server.metrics import Metrics
from specdecode.server.sse import ClientGone, until_disconnect
from specdecode.server.worker import GenerationFailed, Job, QueueFull, ShuttingDown, Worker
from specdecode.stats import SpecStats
from specdecode.text import check_stop_strings, find_stop


class Strict(BaseModel):
    """Base of every request body: types checked strictly ("10" is not a number), unknown
    fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")

MODEL_ALIASES = ("default",)


@dataclass
class ServerContext:
    llm: LLM
    worker: Worker
    metrics: Metrics
    model_name: str
    aliases: tuple[str, ...] = MODEL_ALIASES

    @property
    def context_length(self) -> int:
        return self.llm.target.max_seq_len

    def check_model(self, name: str) -> None:
        if name != self.model_name and name not in self.aliases:
            raise APIError(404, f"the model '{shorten(name)}' does not exist; this server serves "
                                f"'{self.model_name}'", param="model", code="model_not_found")

    async def encode_chat(self, messages: list[dict], param: str = "messages") -> list[int]:
        if not self.llm.tokenizer.has_chat_template:
            raise APIError(400, "this model has no chat template; use /v1/completions",
                           param=param)
        try:
            ids = await asyncio.to_thread(self.llm.encode, messages=messages)
        except ValueError as e:  # text.TemplateRefused (roles the template refuses), ...
            raise APIError(400, str(e), param=param) from None
        except Exception as e:  # any other failure of the template
            raise APIError(400, f"the chat template refused these messages: {e}",
                           param=param) from None
        return self.check_prompt(ids, param)

    async def encode_text(self, prompt: str, param: str = "prompt") -> list[int]:
        try:
            ids = await asyncio.to_thread(self.llm.encode, prompt)
        except Exception as e:  # e.g. text the tokenizer cannot take (lone surrogates)
            raise APIError(400, f"the prompt could not be tokenized: {e}", param=param) from None
        return self.check_prompt(ids, param)

    def check_prompt(self, ids: Sequence[int], param: str) -> list[int]:
        ids = list(ids)
        if not ids:
            raise APIError(400, "the prompt is empty", param=param)
        vocab = self.llm.target.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"token ids must be in 0..{vocab - 1}", param=param)
        if len(ids) >= self.context_length:
            raise APIError(400, f"the prompt has {len(ids)} tokens; this model's context "
                                f"is {self.context_length} tokens, which leaves no room to "
                                f"generate", param=param, code="context_length_exceeded")
        return ids

    def default_max_tokens(self, prompt_ids: Sequence[int]) -> int:
        return max(1, self.context_length - len(prompt_ids))

    def submit(self, prompt_ids: list[int], params: SamplingParams, seed: int | None) -> Job:
        try:
            return self.worker.submit(prompt_ids, params, seed)
        except QueueFull as e:
            raise APIError(429, str(e), code="queue_full",
                           headers={"Retry-After": RETRY_AFTER_SECONDS}) from None
        except ShuttingDown as e:
            raise shutting_down(e) from None


RETRY_AFTER_SECONDS = "1"  # a generation step is well under a second; the queue moves


def shutting_down(e: ShuttingDown) -> APIError:
    return APIError(503, str(e), code="server_shutting_down")


def check_stops(stops: Sequence[str], param: str) -> tuple[str, ...]:
    """The stop strings, or a 400: empty strings, more than MAX_STOP_STRINGS of them
    or one longer than MAX_STOP_CHARS (see specdecode.text)."""
    try:
        check_stop_strings(stops)
    except ValueError as e:
        raise APIError(400, str(e), param=param) from None
    return tuple(stops)


MIN_TEMPERATURE = 1e-5  # below this, sampling is greedy (as vLLM)
MIN_TOP_P = 1e-6  # any top_p in (0, 1e-6] keeps only the top token


def sampling_params(**kw) -> SamplingParams:
    """SamplingParams, with its ValueError turned into a 400.

    Extreme but valid values are mapped to their exact equivalents so they
    cannot underflow in float32: a temperature below 1e-5 is greedy, a top_p
    below 1e-6 is 1e-6 (both keep only the most likely token)."""
    if 0 < kw.get("temperature", 0) < MIN_TEMPERATURE:
        kw["temperature"] = 0.0
    if 0 < kw.get("top_p", 1) < MIN_TOP_P:
        kw["top_p"] = MIN_TOP_P
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        param = str(e).split(" ", 1)[0]
        raise APIError(400, str(e), param=param) from None


def speculative_usage(stats: SpecStats | None, ctx: ServerContext) -> dict:
    """The `speculative` field of a response's usage."""
    stats = stats or SpecStats()
    return {
        "drafter": ctx.llm.info.drafter if ctx.llm.speculative else "none",
        "k": ctx.llm.k,
        "steps": stats.steps,
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "acceptance_rate": round(stats.acceptance_rate, 4),
        "mean_accepted_length": round(stats.mean_accepted_length, 4),
        "tokens_per_second": round(stats.tokens_per_second, 2),
        "drafter_steps": dict(stats.drafter_steps),
        "guard_plain_steps": stats.guard_plain_steps,
        "guard_engagements": stats.guard_engagements,
        "speculation_paused": stats.speculation_paused,
        "drafter_errors": stats.drafter_errors,
    }


def stop_sequence_hit(ctx: ServerContext, token_ids: Sequence[int],
                      stops: Sequence[str]) -> str | None:
    """The stop string that ended the output (the earliest one in the text), if any."""
    if not stops:
        return None
    text = ctx.llm.tokenizer.decode(token_ids)
    at = find_stop(text, stops)
    if at < 0:
        return None
    return min((s for s in stops if text.find(s) == at), key=len)


@dataclass
class Completion:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    stats: SpecStats | None = None

    def add(self, chunk) -> None:
        self.text += chunk.text
        self.token_ids += chunk.token_ids
        self.stats = chunk.stats
        if chunk.finish_reason:
            self.finish_reason = chunk.finish_reason


async def complete(ctx: ServerContext, job: Job, receive) -> Completion:
    """Run a job to the end for a non-streaming response (cancelled if the client leaves)."""

    async def drain() -> Completion:
        out = Completion()
        async for chunk in job.chunks():
            out.add(chunk)
        return out

    try:
        return await until_disconnect(receive, drain())
    except GenerationFailed as e:
        raise APIError(500, f"generation failed: {e}") from None
    except ShuttingDown as e:
        raise shutting_down(e) from None
    except ClientGone:  # nobody reads this answer (nginx's "client closed request")
        raise APIError(499, "the client closed the request") from None
    finally:
        ctx.worker.cancel(job)
