"""ollama's API: /api/generate and /api/chat (NDJSON streams unless "stream": false), /api/tags,
/api/show, /api/ps, /api/version, with ollama's field names, defaults and timing fields."""

from __future__ import annotations

import asyncio
import json
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from nerva_cli.errors import BadInput
from nerva_cli.serve import models, tools
from nerva_cli.serve.errors import ApiError, bad
from nerva_cli.serve.fields import Fields, json_type
from nerva_cli.serve.options import parse_duration
from nerva_cli.serve.pipeline import (GenRequest, answer_format, message_list, read_json, sampling, streamed_answer,
                                      submit, whole_answer)

# ollama's defaults for the options a request leaves out (its api.DefaultOptions)
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.0, "repeat_penalty": 1.1, "repeat_last_n": 64}
WHOLE_CONTEXT = 1 << 16  # repeat_last_n -1 ("the whole context"): more tokens than any context here holds


def _keep_alive(body: Fields, default: float | None) -> float | None:
    if not body.has("keep_alive"):
        return default
    try:
        return parse_duration(body.data["keep_alive"], "'keep_alive'")
    except BadInput as e:
        raise bad(str(e), param="keep_alive") from None


def _request(state, body: Fields, **prompt) -> GenRequest:
    """The fields /api/generate and /api/chat share: model, options, keep_alive."""
    o = body.object("options") or Fields({}, "options")
    d = DEFAULTS
    repeat_last_n = o.integer("repeat_last_n", d["repeat_last_n"], low=-1)
    seed = o.integer("seed")
    num_predict = o.integer("num_predict")
    if num_predict is not None and num_predict < 1 and num_predict not in (-1, -2):
        raise bad(f"'options.num_predict' must be >= 1, or -1 or -2 (to the end of the context), got {num_predict}",
                  param="options.num_predict")
    opts = sampling(temperature=o.number("temperature", d["temperature"], low=0),
                    top_k=o.integer("top_k", d["top_k"], low=0),
                    top_p=o.number("top_p", d["top_p"], low=0, high=1, low_open=True),
                    min_p=o.number("min_p", d["min_p"], low=0, high=1),
                    repeat_penalty=o.number("repeat_penalty", d["repeat_penalty"], low=0, low_open=True),
                    repeat_last_n=WHOLE_CONTEXT if repeat_last_n == -1 else repeat_last_n,
                    seed=None if seed is None or seed < 0 else seed)  # ollama's seed -1: a random one
    model = body.string("model")
    if model is None:
        raise bad("'model' is required", param="model")
    return GenRequest(model=model, sampling=opts, keep_alive=_keep_alive(body, state.options.keep_alive),
                      max_tokens=None if num_predict in (None, -1, -2) else num_predict,
                      num_ctx=o.integer("num_ctx", low=1), stops=o.stops("stop"),
                      truncate=body.boolean("truncate", False), format=_format(body), **prompt)


def _format(body: Fields):
    """ollama's `format`: "json" (any JSON object) or a JSON Schema; "" or absent: free text."""
    value = body.data.get("format")
    if value in (None, ""):
        return None
    if value == "json":
        return answer_format("format")
    if isinstance(value, dict):
        return answer_format("format", value)
    raise bad(f"'format' must be \"json\" or a JSON Schema (an object), got {json.dumps(value)[:60]}", param="format")


def _done_fields(result) -> dict:
    return {"done": True, "done_reason": "length" if result.reason == "length" else "stop",
            "total_duration": result.total_ns, "load_duration": result.load_ns,
            "prompt_eval_count": result.prompt_tokens, "prompt_eval_duration": result.prompt_ns,
            "eval_count": result.gen_tokens, "eval_duration": result.eval_ns}


async def _answer(request: Request, state, req: GenRequest, stream: bool, shape) -> JSONResponse | StreamingResponse:
    """Runs the request; `shape(text)` is the API's field for the text (response, or message)."""
    job = await submit(state, req)
    if not stream or job.tool_style:  # with tools, the whole text: a call is read out of it at the end
        text, result = await whole_answer(state, job, request)
        fields = shape(text)
        if job.tool_style:
            content, calls = tools.parse(text, job.tool_style)
            fields["message"]["content"] = content or ""
            if calls:
                fields["message"]["tool_calls"] = [c.ollama() for c in calls]
        head = {"model": req.model, "created_at": models.now_iso()}
        if not stream:
            return JSONResponse({**head, **fields, **_done_fields(result)})
        return StreamingResponse(iter([json.dumps({**head, **fields, "done": False}) + "\n",
                                       json.dumps({**head, **shape(""), **_done_fields(result)}) + "\n"]),
                                 media_type="application/x-ndjson")
    events = await streamed_answer(state, job, request)

    async def lines():
        try:
            async for kind, payload in events:
                fields = _done_fields(payload) if kind == "done" else {"done": False}
                yield json.dumps({"model": req.model, "created_at": models.now_iso(),
                                  **shape("" if kind == "done" else payload), **fields}) + "\n"
        except ApiError as e:  # failed mid-answer: ollama's way, one error line ends the stream
            yield json.dumps(e.body(openai=False)) + "\n"

    return StreamingResponse(lines(), media_type="application/x-ndjson")


async def _load_or_unload(state, body: Fields, shape) -> JSONResponse:
    """A request without a prompt (or messages) loads the model, or with keep_alive 0 unloads it."""
    ref = body.string("model")
    key, model = await asyncio.to_thread(models.resolve, ref)
    keep_alive = _keep_alive(body, state.options.keep_alive)
    if keep_alive == 0:
        state.registry.unload(key)
        reason = "unload"
    else:
        worker = state.registry.load(key, model, keep_alive)
        await asyncio.to_thread(worker.loaded.wait)
        if worker.error is not None:
            raise worker.error
        reason = "load"
    return JSONResponse({"model": key, "created_at": models.now_iso(), **shape(""), "done": True,
                         "done_reason": reason})


async def generate(request: Request):
    state = request.app.state.nerva
    body = Fields(await read_json(request, state.options.max_body))
    prompt = body.string("prompt", "")
    body.refuse("suffix", "fill-in-the-middle needs a template that takes it", allowed=(None, ""))
    body.refuse("template", "the model's own chat template is used", allowed=(None, ""))
    body.refuse("images", "images", allowed=(None, []))
    body.refuse("context", "ollama's deprecated context tokens: send the conversation to /api/chat", allowed=(None, []))
    raw, stream, system = body.boolean("raw", False), body.boolean("stream", True), body.string("system")

    def shape(text):
        return {"response": text}

    if not prompt:
        return await _load_or_unload(state, body, shape)
    req = _request(state, body, prompt=prompt, templated=not raw, system=system)
    return await _answer(request, state, req, stream, shape)


def _content(value, where: str) -> str:
    if not isinstance(value, str):
        raise bad(f"'{where}' must be a string, got {json_type(value)}", param=where)
    return value


async def chat(request: Request):
    state = request.app.state.nerva
    body = Fields(await read_json(request, state.options.max_body))
    body.refuse("think", "thinking output", allowed=(None, False))
    stream = body.boolean("stream", True)

    def shape(text):
        return {"message": {"role": "assistant", "content": text}}

    if body.array("messages") in (None, []):  # ollama's way to load (or with keep_alive 0 unload) a model
        return await _load_or_unload(state, body, shape)
    req = _request(state, body, messages=message_list(body.data["messages"], _content),
                   tools=tools.tool_list(body.data.get("tools")))
    return await _answer(request, state, req, stream, shape)


async def tags(request: Request):
    found = await asyncio.to_thread(lambda: [models.ollama_entry(m) for m in models.stored_models()])
    return JSONResponse({"models": found})


async def show(request: Request):
    state = request.app.state.nerva
    body = Fields(await read_json(request, state.options.max_body))
    ref = body.string("model") or body.string("name")

    def describe():
        from nerva_cli.store.tokenizer import open_tokenizer

        key, model = models.resolve(ref)
        template = open_tokenizer(model.path).template or ""
        return {"license": "", "modelfile": "", "parameters": "", "template": template,
                "details": models.details(model), "model_info": models.model_info(model),
                "capabilities": ["completion"] + (["tools"] if tools.call_style(template) else []),
                "modified_at": models.iso(models.modified(model))}

    return JSONResponse(await asyncio.to_thread(describe))


NEVER = "9999-12-31T23:59:59Z"  # what /api/ps says of a model kept for ever


async def ps(request: Request):
    now_wall, now = time.time(), time.monotonic()
    out = []
    for w in request.app.state.nerva.registry.loaded():
        facts = w.facts()
        if facts is None:  # unloading meanwhile
            continue
        entry = models.ollama_entry(w.model)
        entry.pop("modified_at")
        expires = facts["expires_at"]
        out.append({**entry, "name": w.key, "model": w.key, "size": facts["size"], "size_vram": facts["size_vram"],
                    "context_length": facts["ctx"],
                    "expires_at": NEVER if expires is None else models.iso(now_wall + expires - now)})
    return JSONResponse({"models": out})


async def version(request: Request):
    from nerva_cli import __version__

    return JSONResponse({"version": __version__})


async def root(request: Request):
    return PlainTextResponse("nerva is running")


ROUTES = [
    Route("/", root, methods=["GET", "HEAD"]),
    Route("/api/generate", generate, methods=["POST"]),
    Route("/api/chat", chat, methods=["POST"]),
    Route("/api/tags", tags, methods=["GET"]),
    Route("/api/show", show, methods=["POST"]),
    Route("/api/ps", ps, methods=["GET"]),
    Route("/api/version", version, methods=["GET"]),
]
