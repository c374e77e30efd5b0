"""OpenAI's API: /v1/chat/completions and /v1/completions (server-sent events ending in
`data: [DONE]` when streamed), /v1/models. What nerva does not do yet (n > 1, penalties other
than repeat_penalty) is refused by name rather than ignored."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from nerva_cli.serve import models, tools
from nerva_cli.serve.errors import ApiError, bad
from nerva_cli.serve.fields import Fields, json_type
from nerva_cli.serve.pipeline import (GenRequest, answer_format, message_list, read_json, sampling, streamed_answer,
                                      submit, whole_answer)


def _request(state, body: Fields, top_logprobs: int | None = None, **prompt) -> tuple[GenRequest, bool, bool]:
    """The fields both endpoints share -> (request, stream, include_usage). Sampling defaults
    are OpenAI's (temperature 1, top_p 1: the whole distribution); top_k, min_p and
    repeat_penalty are taken as llama.cpp's server takes them."""
    body.refuse("n", "one answer per request", allowed=(None, 1))
    body.refuse("best_of", "one answer per request", allowed=(None, 1))
    for name in ("frequency_penalty", "presence_penalty"):
        body.refuse(name, "it does not map onto nerva's penalty; repeat_penalty (llama.cpp's) does it the "
                          "way nerva samples", allowed=(None, 0, 0.0))
    body.refuse("functions", "the deprecated form of 'tools': send 'tools'", allowed=(None, []))
    model = body.string("model")
    if model is None:
        raise bad("'model' is required", param="model")
    limit = body.integer("max_completion_tokens", low=1)
    limit = body.integer("max_tokens", low=1) if limit is None else limit
    opts = sampling(temperature=body.number("temperature", 1.0, low=0, high=2),
                    top_p=body.number("top_p", 1.0, low=0, high=1, low_open=True),
                    top_k=body.integer("top_k", 0, low=0), min_p=body.number("min_p", 0.0, low=0, high=1),
                    repeat_penalty=body.number("repeat_penalty", 1.0, low=0, low_open=True),
                    seed=body.integer("seed", low=0))
    stream = body.boolean("stream", False)
    stream_options = body.object("stream_options") or Fields({}, "stream_options")
    offered = tools.tool_list(body.data.get("tools")) if "messages" in prompt else None
    choice = _tool_choice(body, offered)
    if offered and choice == "none":
        offered = None  # the template is not told of them: no call can come back
    elif body.has("tools") and "messages" not in prompt:
        raise bad("'tools' are for /v1/chat/completions", param="tools")
    req = GenRequest(model=model, sampling=opts, keep_alive=state.options.keep_alive, max_tokens=limit,
                     stops=body.stops("stop"), top_logprobs=top_logprobs, tools=offered,
                     call=None if choice in ("auto", "none") else choice, format=_response_format(body), **prompt)
    return req, stream, stream_options.boolean("include_usage", False)


def _tool_choice(body: Fields, offered: list[dict] | None) -> str:
    """OpenAI's tool_choice: "auto" (the default), "none", "required" (a call, to any of the tools)
    or {"type": "function", "function": {"name": ...}} (a call to that one) -> that name."""
    value = body.data.get("tool_choice")
    if value is None or value in ("auto", "none"):
        return value or "auto"
    if value == "required" or isinstance(value, dict):
        if not offered:
            raise bad("'tool_choice' asks for a call, and no 'tools' were given", param="tool_choice")
        if value == "required":
            return value
        name = (value.get("function") or {}).get("name") if value.get("type") == "function" else None
        names = [t["function"]["name"] for t in offered]
        if name not in names:
            raise bad(f"'tool_choice' must name one of the tools given ({', '.join(names)}): "
                      f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", param="tool_choice")
        return name
    raise bad(f"'tool_choice' must be \"auto\", \"none\", \"required\" or a function by name, got "
              f"{json.dumps(value)[:60]}", param="tool_choice")


def _response_format(body: Fields):
    """OpenAI's response_format: {"type": "text"} (free text), "json_object" (any JSON object) or
    "json_schema" with {"name", "schema", "strict"} (the schema held to whatever `strict` says:
    nerva has no loose mode)."""
    rf = body.object("response_format")
    if rf is None:
        return None
    kind = rf.string("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return answer_format("response_format")
    if kind == "json_schema":
        spec = rf.object("json_schema")
        if spec is None:
            raise bad("'response_format.json_schema' is required with type json_schema", param="response_format")
        spec.string("name")
        spec.boolean("strict", True)
        schema = spec.data.get("schema")
        return answer_format("response_format.json_schema.schema", schema) if schema is not None else \
            answer_format("response_format.json_schema")
    raise bad(f"'response_format.type' must be text, json_object or json_schema, got "
              f"{json.dumps(kind) if kind is not None else 'nothing'}", param="response_format.type")


def _usage(result) -> dict:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.gen_tokens,
            "total_tokens": result.prompt_tokens + result.gen_tokens,
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens}}


def _finish(result, calls=()) -> str:
    return "tool_calls" if calls else "length" if result.reason == "length" else "stop"


def _message(text: str, style: str | None) -> tuple[dict, list]:
    """The assistant's message, its tool calls read out of the text where the request had tools."""
    content, calls = tools.parse(text, style) if style else (text, [])
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [c.openai() for c in calls]
    return message, calls


class _Logprobs:
    """A job's token log-probabilities in the API's shape: chat's `content` entries, or the
    completions' token_logprobs lists. Streamed, each chunk carries the tokens scored since the
    last one (a token's text may come later than its score: a possible stop string is held back)."""

    def __init__(self, job, kind: str):
        self.job, self.kind, self.sent, self.offset = job, kind, 0, 0

    def _piece(self, token: int) -> str:
        return self.job.tokenizer.decode([token])

    def take(self) -> dict | None:
        if self.job.top_logprobs is None:
            return None
        scored = self.job.logprobs[self.sent:]
        self.sent += len(scored)
        if self.kind == "chat":
            return {"content": [self._chat_entry(token, lp, top) for token, lp, top in scored], "refusal": None}
        pieces = [self._piece(token) for token, _, _ in scored]
        offsets = []
        for piece in pieces:
            offsets.append(self.offset)
            self.offset += len(piece)
        return {"tokens": pieces, "token_logprobs": [lp for _, lp, _ in scored],
                "top_logprobs": [{self._piece(i): v for i, v in top} for _, _, top in scored],
                "text_offset": offsets}

    def _chat_entry(self, token: int, lp: float, top) -> dict:
        def entry(i: int, v: float) -> dict:
            piece = self._piece(i)
            return {"token": piece, "logprob": v, "bytes": list(piece.encode())}

        return {**entry(token, lp), "top_logprobs": [entry(i, v) for i, v in top]}


async def _answer(request: Request, state, req: GenRequest, stream: bool, include_usage: bool, kind: str):
    """kind: "chat" or "text" (completions)."""
    job = await submit(state, req)
    scores = _Logprobs(job, kind)
    head = {"id": f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()), "model": req.model}
    if not stream:
        text, result = await whole_answer(state, job, request)
        message, calls = _message(text, job.tool_style)
        choice = {"message": message} if kind == "chat" else {"text": text}
        return JSONResponse({**head, "choices": [{"index": 0, **choice, "logprobs": scores.take(),
                                                  "finish_reason": _finish(result, calls)}], "usage": _usage(result)})
    events = await streamed_answer(state, job, request)
    if kind == "chat":
        head["object"] = "chat.completion.chunk"

    def chunk(delta: str | None, finish: str | None, first: bool = False) -> str:
        if kind == "chat":
            body = {"delta": ({"role": "assistant", "content": delta} if first else
                              {} if delta is None else {"content": delta})}
        else:
            body = {"text": delta or ""}
        usage = {"usage": None} if include_usage else {}
        logprobs = None if first else scores.take()
        return _sse({**head, "choices": [{"index": 0, **body, "logprobs": logprobs, "finish_reason": finish}],
                     **usage})

    async def frames():
        held = []  # with tools, the whole text: a call is read out of it at the end
        try:
            if kind == "chat":
                yield chunk("", None, first=True)
            async for what, payload in events:
                if what == "text" and job.tool_style:
                    held.append(payload)
                elif what == "text":
                    yield chunk(payload, None)
                if what == "text":
                    continue
                calls = []
                if job.tool_style:
                    message, calls = _message("".join(held), job.tool_style)
                    if message["content"]:
                        yield chunk(message["content"], None)
                    if calls:
                        deltas = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
                        yield _sse({**head, "choices": [{"index": 0, "delta": {"tool_calls": deltas},
                                                         "logprobs": None, "finish_reason": None}]})
                yield chunk(None, _finish(payload, calls))
                if include_usage:
                    yield _sse({**head, "choices": [], "usage": _usage(payload)})
            yield "data: [DONE]\n\n"
        except ApiError as e:  # failed mid-answer: one error event ends the stream
            yield _sse(e.body(openai=True))

    return StreamingResponse(frames(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _content(value, where: str) -> str:
    """A message's content: a string, or an array of text parts."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) for p in value):
        if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in value):
            raise bad(f"'{where}': only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported", param=where)
        return "".join(p["text"] for p in value)
    raise bad(f"'{where}' must be a string or an array of text parts, got {json_type(value)}", param=where)


async def chat_completions(request: Request):
    state = request.app.state.nerva
    body = Fields(await read_json(request, state.options.max_body))
    top = body.integer("top_logprobs", low=0, high=20)
    if top is not None and not body.boolean("logprobs", False):
        raise bad("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    req, stream, usage = _request(state, body, top_logprobs=(top or 0) if body.boolean("logprobs", False) else None,
                                  messages=message_list(body.data.get("messages"), _content))
    return await _answer(request, state, req, stream, usage, "chat")


async def completions(request: Request):
    state = request.app.state.nerva
    body = Fields(await read_json(request, state.options.max_body))
    body.refuse("echo", "echoing the prompt", allowed=(None, False))
    body.refuse("suffix", "fill-in-the-middle", allowed=(None, ""))
    prompt = body.data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # a batch of one
    if not isinstance(prompt, str):
        raise bad("'prompt' must be a string (or an array of one string)", param="prompt")
    req, stream, usage = _request(state, body, top_logprobs=body.integer("logprobs", low=0, high=5), prompt=prompt)
    return await _answer(request, state, req, stream, usage, "text")


async def list_models(request: Request):
    found = await asyncio.to_thread(lambda: [models.openai_entry(m) for m in models.stored_models()])
    return JSONResponse({"object": "list", "data": found})


async def get_model(request: Request):
    _, model = await asyncio.to_thread(models.resolve, request.path_params["model"])
    return JSONResponse(models.openai_entry(model))


ROUTES = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model:path}", get_model, methods=["GET"]),
]
