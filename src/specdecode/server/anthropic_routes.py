"""Anthropic-compatible route: POST /v1/messages, plain JSON or streamed events.

The stream is the Messages API's event sequence (message_start,
content_block_start, ping, content_block_delta text_delta..., content_block_stop,
message_delta with stop_reason and usage.output_tokens, message_stop), which
the official `anthropic` SDK accumulates into a Message. `usage.speculative`
carries the speculative stats (in message_delta when streaming).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Literal

from fastapi import APIRouter, Request
from pydantic import Field

from specdecode.server.errors import APIError, shorten
from specdecode.server.generation import (
    Completion,
    ServerContext,
    Strict,
    check_stops,
    complete,
    sampling_params,
    speculative_usage,
    stop_sequence_hit,
)
from specdecode.server.sse import EventStream, sse
from specdecode.server.worker import GenerationFailed, Job, ShuttingDown

router = APIRouter()


class TextBlock(Strict):
    type: str
    text: str | None = None


class Message(Strict):
    role: Literal["user", "assistant"]
    content: str | list[TextBlock]


class MessagesRequest(Strict):
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = Field(None, max_length=16)
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    metadata: dict | None = None
    tools: list | None = None
    tool_choice: dict | None = None
    thinking: dict | None = None


def _text(content: str | list[TextBlock], param: str) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for j, block in enumerate(content):
        if block.type != "text":
            raise APIError(400, f"only text content blocks are supported, got "
                                f"'{shorten(block.type)}'", param=f"{param}[{j}]")
        if block.text is None:
            raise APIError(400, f"{param}[{j}]: a content block of type 'text' needs a "
                                "'text' string", param=f"{param}[{j}].text")
        parts.append(block.text)
    return "".join(parts)


def _messages(req: MessagesRequest) -> list[dict]:
    if req.tools:
        raise APIError(400, "tools are not supported")
    if req.tool_choice is not None and req.tool_choice.get("type") != "none":
        raise APIError(400, "tool_choice is not supported (tools are not supported)")
    if req.thinking and req.thinking.get("type") != "disabled":
        raise APIError(400, "extended thinking is not supported")
    if req.messages[-1].role != "user":
        raise APIError(400, "the last message must have role 'user' (assistant prefill is "
                            "not supported)")
    out = []
    if req.system:
        out.append({"role": "system", "content": _text(req.system, "system")})
    out += [{"role": m.role, "content": _text(m.content, f"messages[{i}].content")}
            for i, m in enumerate(req.messages)]
    return out


def _stop(ctx: ServerContext, out: Completion, stops: tuple[str, ...]) -> tuple[str, str | None]:
    if out.finish_reason == "length":
        return "max_tokens", None
    hit = stop_sequence_hit(ctx, out.token_ids, stops)
    return ("stop_sequence", hit) if hit else ("end_turn", None)


@router.post("/v1/messages")
async def messages(req: MessagesRequest, request: Request):
    ctx: ServerContext = request.app.state.ctx
    ctx.check_model(req.model)
    stops = check_stops(tuple(req.stop_sequences or ()), "stop_sequences")
    ids = await ctx.encode_chat(_messages(req))
    params = sampling_params(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
        max_tokens=req.max_tokens, stop=stops)
    job = ctx.submit(ids, params, None)
    mid = f"msg_{uuid.uuid4().hex}"
    if req.stream:
        return EventStream(_events(ctx, job, len(ids), mid, stops),
                           on_close=lambda: ctx.worker.cancel(job))
    out = await complete(ctx, job, request.receive)
    stop_reason, stop_sequence = _stop(ctx, out, stops)
    return {"id": mid, "type": "message", "role": "assistant", "model": ctx.model_name,
            "content": [{"type": "text", "text": out.text}],
            "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": {"input_tokens": len(ids), "output_tokens": len(out.token_ids),
                      "cache_read_input_tokens": _cached(out),
                      "speculative": speculative_usage(out.stats, ctx)}}


def _cached(out: Completion) -> int:
    """Prompt tokens reused from the prefix cache (counted in input_tokens too: unlike
    Anthropic's billing split, input_tokens here is the whole prompt)."""
    return out.stats.cached_tokens if out.stats is not None else 0


async def _events(ctx: ServerContext, job: Job, input_tokens: int, mid: str,
                  stops: tuple[str, ...]) -> AsyncIterator[str]:
    start = {"id": mid, "type": "message", "role": "assistant", "model": ctx.model_name,
             "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": input_tokens, "output_tokens": 0}}
    yield sse({"type": "message_start", "message": start}, "message_start")
    yield sse({"type": "content_block_start", "index": 0,
               "content_block": {"type": "text", "text": ""}}, "content_block_start")
    yield sse({"type": "ping"}, "ping")
    out = Completion()
    try:
        async for c in job.chunks():
            out.add(c)
            if c.text:
                yield sse({"type": "content_block_delta", "index": 0,
                           "delta": {"type": "text_delta", "text": c.text}},
                          "content_block_delta")
    except GenerationFailed as e:
        yield sse({"type": "error", "error": {"type": "api_error",
                                              "message": f"generation failed: {e}"}}, "error")
        return
    except ShuttingDown as e:
        yield sse({"type": "error", "error": {"type": "overloaded_error", "message": str(e)}},
                  "error")
        return
    yield sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
    stop_reason, stop_sequence = _stop(ctx, out, stops)
    yield sse({"type": "message_delta",
               "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
               "usage": {"output_tokens": len(out.token_ids),
                         "cache_read_input_tokens": _cached(out),
                         "speculative": speculative_usage(out.stats, ctx)}}, "message_delta")
    yield sse({"type": "message_stop"}, "message_stop")
