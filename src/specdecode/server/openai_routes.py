"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models.

Requests are validated strictly (wrong types are 400s, not coerced); fields
the engine cannot honour (n > 1, logprobs, tools, penalties, echo, ...) get a
400 that says so rather than being ignored. Every response's `usage` carries
the speculative stats in an extra `speculative` object; when streaming it is
in the final usage chunk (`stream_options: {"include_usage": true}`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Literal

from fastapi import APIRouter, Request
from pydantic import ConfigDict, Field

from specdecode.server.errors import APIError, shorten
from specdecode.server.generation import (
    Completion,
    ServerContext,
    Strict,
    check_stops,
    complete,
    sampling_params,
    speculative_usage,
)
from specdecode.server.sse import EventStream, sse
from specdecode.server.worker import GenerationFailed, Job, ShuttingDown

router = APIRouter()
STARTED = int(time.time())

StopList = Annotated[list[str], Field(max_length=16)]


class ContentPart(Strict):
    type: str
    text: str | None = None


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class StreamOptions(Strict):
    include_usage: bool = False


# Other engines' fields that change the output (vLLM's and llama-server's extensions),
# with their neutral value: any other value is refused, never ignored. Unknown fields
# beyond these (metadata, store, ...) are ignored, as OpenAI's own optional fields.
EXTENSIONS = {
    # vLLM
    "repetition_penalty": 1.0, "length_penalty": 1.0, "min_tokens": 0,
    "stop_token_ids": None, "bad_words": None, "allowed_token_ids": None,
    "guided_json": None, "guided_regex": None, "guided_choice": None,
    "guided_grammar": None, "structured_outputs": None, "use_beam_search": False,
    "prompt_logprobs": None, "logits_processors": None,
    "include_stop_str_in_output": False, "skip_special_tokens": True,
    "spaces_between_special_tokens": True, "chat_template": None,
    "chat_template_kwargs": None, "add_generation_prompt": True,
    "continue_final_message": False, "truncate_prompt_tokens": None,
    # llama-server (the samplers below are off at any value <= 0: OFF_AT_OR_BELOW_0)
    "repeat_penalty": 1.0, "grammar": None, "json_schema": None, "typical_p": 1.0,
    "tfs_z": 1.0, "mirostat": 0, "dry_multiplier": 0.0, "xtc_probability": 0.0,
    "dynatemp_range": 0.0, "top_n_sigma": -1.0, "n_probs": 0, "n_predict": -1,
    "samplers": None,
}
OFF_AT_OR_BELOW_0 = frozenset({"mirostat", "dry_multiplier", "xtc_probability",
                               "dynatemp_range", "top_n_sigma", "n_probs"})


def _neutral(name: str, value: object) -> bool:
    """Whether extension field `name`'s value asks for nothing (null, empty, its neutral
    value, or <= 0 for a sampler that is off there)."""
    neutral = EXTENSIONS[name]
    if value is None or value == [] or value == {} or value == "":
        return True
    if name in OFF_AT_OR_BELOW_0 and isinstance(value, int | float) and not isinstance(
            value, bool) and value <= 0:
        return True
    if neutral is None or isinstance(value, str):
        return False
    if isinstance(neutral, bool):
        return value is neutral or (not isinstance(value, bool) and value == neutral)
    return not isinstance(value, bool) and value == neutral


class SamplingFields(Strict):
    model_config = ConfigDict(strict=True, extra="allow")  # extras: EXTENSIONS checked

    model: str
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)  # extension, as vLLM
    min_p: float | None = Field(None, ge=0, le=1)  # extension, as vLLM
    max_tokens: int | None = Field(None, ge=1)
    stop: str | StopList | None = None
    seed: int | None = Field(None, ge=0, le=2**64 - 1)
    n: int | None = Field(None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = False  # extension, as vLLM


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list | None = None
    tool_choice: str | dict | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    response_format: dict | None = None
    modalities: list[str] | None = None
    audio: dict | None = None
    prediction: dict | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = None
    best_of: int | None = Field(None, ge=1)


def _refuse_unsupported(req: SamplingFields) -> None:
    checks = [
        ((req.n or 1) > 1, "n", "n > 1 is not supported; send one request per completion"),
        (bool(req.presence_penalty), "presence_penalty", "presence_penalty is not supported"),
        (bool(req.frequency_penalty), "frequency_penalty", "frequency_penalty is not supported"),
        (bool(req.logit_bias), "logit_bias", "logit_bias is not supported"),
        (req.stream_options is not None and not req.stream, "stream_options",
         "stream_options is only allowed with stream: true"),
    ]
    if isinstance(req, ChatRequest):
        checks += [
            (bool(req.logprobs), "logprobs", "logprobs are not supported"),
            (req.top_logprobs is not None, "top_logprobs",
             "top_logprobs is not supported (logprobs are not supported)"),
            (bool(req.tools), "tools", "tools are not supported"),
            (req.tool_choice not in (None, "none"), "tool_choice",
             "tool_choice is not supported (tools are not supported); omit it or send \"none\""),
            (bool(req.functions), "functions", "functions are not supported"),
            (req.function_call not in (None, "none"), "function_call",
             "function_call is not supported"),
            (req.modalities not in (None, ["text"]), "modalities",
             "only the \"text\" modality is supported"),
            (req.audio is not None, "audio", "audio output is not supported"),
            (req.prediction is not None, "prediction", "predicted outputs are not supported"),
            (req.response_format is not None and req.response_format.get("type") != "text",
             "response_format", "only response_format {\"type\": \"text\"} is supported"),
        ]
    if isinstance(req, CompletionRequest):
        checks += [
            (req.echo, "echo", "echo is not supported"),
            (req.suffix is not None, "suffix", "suffix is not supported"),
            (req.logprobs is not None, "logprobs", "logprobs are not supported"),
            ((req.best_of or 1) > 1, "best_of", "best_of > 1 is not supported"),
        ]
    for name, value in (req.model_extra or {}).items():
        if name in EXTENSIONS and not _neutral(name, value):
            checks.append((True, name, f"{name} is not supported"))
    for bad, param, message in checks:
        if bad:
            raise APIError(400, message, param=param)


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    return check_stops((stop,) if isinstance(stop, str) else tuple(stop or ()), "stop")


def _params(ctx: ServerContext, req: SamplingFields, ids: list[int], max_tokens: int | None):
    return sampling_params(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
        min_p=req.min_p or 0.0, max_tokens=max_tokens or ctx.default_max_tokens(ids),
        stop=_stops(req.stop), ignore_eos=req.ignore_eos)


def _message_text(m: ChatMessage, i: int) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    parts = []
    for j, part in enumerate(m.content):
        param = f"messages[{i}].content[{j}]"
        if part.type != "text":
            raise APIError(400, f"only text content parts are supported, got "
                                f"'{shorten(part.type)}'", param=param)
        if part.text is None:
            raise APIError(400, "a content part of type 'text' needs a 'text' string",
                           param=f"{param}.text")
        parts.append(part.text)
    return "".join(parts)


def _usage(ctx: ServerContext, prompt_tokens: int, out: Completion) -> dict:
    n = len(out.token_ids)
    cached = out.stats.cached_tokens if out.stats is not None else 0
    return {"prompt_tokens": prompt_tokens, "completion_tokens": n,
            "total_tokens": prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": cached},  # reused from the prefix cache
            "speculative": speculative_usage(out.stats, ctx)}


@router.api_route("/v1/models", methods=["GET", "HEAD"])
async def list_models(request: Request) -> dict:
    return {"object": "list", "data": [_model_card(request.app.state.ctx)]}


@router.api_route("/v1/models/{model}", methods=["GET", "HEAD"])
async def get_model(model: str, request: Request) -> dict:
    ctx: ServerContext = request.app.state.ctx
    ctx.check_model(model)
    return _model_card(ctx)


def _model_card(ctx: ServerContext) -> dict:
    return {"id": ctx.model_name, "object": "model", "created": STARTED,
            "owned_by": "specdecode", "max_model_len": ctx.context_length}


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatRequest, request: Request):
    ctx: ServerContext = request.app.state.ctx
    ctx.check_model(req.model)
    _refuse_unsupported(req)
    messages = [{"role": "system" if m.role == "developer" else m.role,
                 "content": _message_text(m, i)} for i, m in enumerate(req.messages)]
    ids = await ctx.encode_chat(messages)
    return await _respond(ctx, req, request, ids, req.max_completion_tokens or req.max_tokens,
                          chat=True)


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request):
    ctx: ServerContext = request.app.state.ctx
    ctx.check_model(req.model)
    _refuse_unsupported(req)
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, "batched prompts are not supported; send one prompt",
                           param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = await ctx.encode_text(prompt)
    else:
        ids = ctx.check_prompt(prompt, "prompt")
    return await _respond(ctx, req, request, ids, req.max_tokens, chat=False)


async def _respond(ctx: ServerContext, req: SamplingFields, request: Request, ids: list[int],
                   max_tokens: int | None, chat: bool):
    """Queue the job; answer as an SSE stream or one JSON body (chat or completion shape)."""
    job = ctx.submit(ids, _params(ctx, req, ids, max_tokens), req.seed)
    prefix, obj, chunk_obj = (("chatcmpl", "chat.completion", "chat.completion.chunk") if chat
                              else ("cmpl", "text_completion", "text_completion"))
    rid, created = f"{prefix}-{uuid.uuid4().hex}", int(time.time())
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        events = _stream(ctx, job, len(ids), rid, created, chunk_obj, include_usage)
        return EventStream(events, on_close=lambda: ctx.worker.cancel(job))
    out = await complete(ctx, job, request.receive)
    choice = {"index": 0, "logprobs": None, "finish_reason": out.finish_reason}
    if chat:
        choice["message"] = {"role": "assistant", "content": out.text}
    else:
        choice["text"] = out.text
    return {"id": rid, "object": obj, "created": created, "model": ctx.model_name,
            "system_fingerprint": None, "choices": [choice], "usage": _usage(ctx, len(ids), out)}


async def _stream(ctx: ServerContext, job: Job, prompt_tokens: int, rid: str, created: int,
                  kind: str, include_usage: bool) -> AsyncIterator[str]:
    """SSE chunks of a chat completion or a text completion, then `data: [DONE]`."""
    chat = kind == "chat.completion.chunk"
    base = {"id": rid, "object": kind, "created": created, "model": ctx.model_name,
            "system_fingerprint": None}
    if include_usage:
        base["usage"] = None

    def chunk(text: str | None, finish: str | None = None, role: bool = False) -> str:
        if chat:
            delta = ({"role": "assistant"} if role else {}) | (
                {"content": text} if text is not None else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return sse(base | {"choices": [choice]})

    out = Completion()
    if chat:
        yield chunk("", role=True)
    try:
        async for c in job.chunks():
            out.add(c)
            if c.text:
                yield chunk(c.text)
    except (GenerationFailed, ShuttingDown) as e:
        failed = isinstance(e, GenerationFailed)
        yield sse({"error": {"message": f"generation failed: {e}" if failed else str(e),
                             "type": "server_error", "param": None,
                             "code": None if failed else "server_shutting_down"}})
        yield sse("[DONE]")
        return
    yield chunk(None if chat else "", out.finish_reason)
    if include_usage:
        yield sse(base | {"choices": [], "usage": _usage(ctx, prompt_tokens, out)})
    yield sse("[DONE]")
