"""What both APIs do between a request's body and its answer: read the body (bounded), find
the model, turn the prompt or the messages into tokens with the model's own template, check
them against the context, queue the job, and hand its events back while watching the client."""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, field

from starlette.requests import ClientDisconnect, Request

from nerva_cli.errors import NervaError
from nerva_cli.runtime.chat import fit_turns
from nerva_cli.runtime.sampling import SamplingOptions
from nerva_cli.serve import tools
from nerva_cli.serve.errors import ApiError, bad
from nerva_cli.serve.job import Job

ROLES = ("system", "user", "assistant", "tool")


async def read_json(request: Request, limit: int) -> dict:
    """The body as a JSON object; 413 as soon as it is past `limit` bytes (by its Content-Length
    before anything is read, else while it streams in), 400 for anything not UTF-8 JSON."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ApiError(413, f"the body is {int(length)} bytes; this server takes at most {limit}")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise ApiError(413, f"the body is past {limit} bytes, the most this server takes")
    except ClientDisconnect:
        raise ApiError(400, "the client went away while sending the body") from None
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad(f"the body is not valid UTF-8 (byte {e.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise bad(f"the body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None
    except (ValueError, RecursionError) as e:  # an integer of 5000 digits, arrays nested 100k deep
        raise bad(f"the body is not JSON this server reads: {type(e).__name__}") from None
    if not isinstance(data, dict):
        raise bad("the body must be a JSON object")
    return data


def message_list(value, text_of) -> list[dict]:
    """Chat messages as the template takes them: role and text. `text_of(content, where)` reads
    a message's content as its API writes it."""
    if not isinstance(value, list) or not value:
        raise bad("'messages' must be a non-empty array of messages", param="messages")
    messages = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"'{where}' must be an object with a role and content", param=where)
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"'{where}.role' must be one of {', '.join(ROLES)}, got {json.dumps(role)[:40]}",
                      param=f"{where}.role")
        if m.get("images"):
            raise bad(f"'{where}': images are not supported", param=where)
        calls = m.get("tool_calls")
        content = m.get("content")
        message = {"role": role, "content": "" if content is None and calls else text_of(content, f"{where}.content")}
        if calls:
            if role != "assistant":
                raise bad(f"'{where}': only an assistant message holds tool calls", param=where)
            message["tool_calls"] = tools.message_calls(calls, f"{where}.tool_calls")
        for key in ("tool_call_id", "name", "tool_name"):  # which call a tool's result answers
            if role == "tool" and isinstance(m.get(key), str):
                message[key] = m[key]
        messages.append(message)
    return messages


def uses_tools(req) -> bool:
    return bool(req.tools) or any(m["role"] == "tool" or "tool_calls" in m for m in req.messages or ())


@dataclass
class GenRequest:
    """A generation request, whichever API it came through."""

    model: str
    sampling: SamplingOptions
    keep_alive: float | None
    messages: list[dict] | None = None  # a chat, rendered with the model's template
    prompt: str | None = None  # else a prompt: as it is, or with `templated` as the user's message
    templated: bool = False
    system: str | None = None
    max_tokens: int | None = None  # None: to the end of the context
    num_ctx: int | None = None  # a smaller context for this request (ollama's option)
    stops: list[str] = field(default_factory=list)
    tools: list[dict] | None = None  # for the chat template (tools.tool_list's shape)
    call: str | None = None  # a call the answer must be: "required" (to any tool) or a tool's name
    top_logprobs: int | None = None  # None: no log-probabilities; n: each token's and the n likeliest's
    truncate: bool = False  # ollama's: past the context, drop the oldest turns (the prompt's start) instead of a 400
    format: object = None  # structured.Format the answer is held to (ollama's format, OpenAI's response_format)


def answer_format(param: str, schema=None):
    """The structured.Format of JSON held to `schema` (None: any JSON object), from the request's
    field `param`; a 400 naming it with what the grammar engine refused: an answer is never left
    unconstrained."""
    from nerva_cli.structured.formats import json_object, json_schema

    try:
        return json_object(f"'{param}'") if schema is None else json_schema(schema, f"'{param}'")
    except NervaError as e:
        raise bad(str(e), param=param) from None


def sampling(**given) -> SamplingOptions:
    """SamplingOptions from the request's fields (already range-checked), or a 400."""
    try:
        return SamplingOptions(**{k: v for k, v in given.items() if v is not None})
    except NervaError as e:  # its messages name the CLI's flags: --top-k is top_k here
        raise bad(re.sub(r"--([a-z-]+)", lambda m: m.group(1).replace("-", "_"), str(e))) from None


def _prompt_ids(tokenizer, req: GenRequest, ctx: int) -> list[int]:
    """The prompt's tokens; with `truncate`, cut to leave room for an answer in `ctx` (the
    room `run`'s chat leaves: min(max_tokens, a quarter of the context))."""
    room = min(req.max_tokens or ctx, max(1, ctx // 4))
    try:
        if req.messages is None and not (req.templated and tokenizer.template):
            ids = tokenizer.encode(req.prompt)
            if req.truncate and len(ids) > ctx - room:  # the start goes, a BOS token stays
                keep = 1 if tokenizer.add_bos and ids[0] == tokenizer.bos_id else 0
                ids = ids[:keep] + ids[len(ids) - (ctx - room) + keep:]
            return ids
        messages = req.messages
        if messages is None:
            messages = ([{"role": "system", "content": req.system}] if req.system else []) + \
                       [{"role": "user", "content": req.prompt}]
        elif not tokenizer.template:
            raise bad(f"{req.model} has no chat template: send its prompt as it is (/api/generate, /v1/completions)")

        def render(kept):
            text = tokenizer.render_chat(kept, add_generation_prompt=True, tools=req.tools)
            return tokenizer.encode(text, add_special=False)

        if not req.truncate:
            return render(messages)
        return fit_turns(messages, render, ctx, room)[1]
    except NervaError as e:  # the template refusing these messages (roles out of order, say)
        raise bad(str(e)) from None


def _prepare(req: GenRequest, engine_ctx: int | None):
    """On a thread (a template and a tokenizer run here): -> (key, model, tokenizer, ids,
    max_tokens, the template's tool call style where the request uses tools, the answer's
    structured.Constraint or None)."""
    from nerva_cli.planes.base import context_length
    from nerva_cli.serve.models import resolve
    from nerva_cli.store.tokenizer import open_tokenizer

    key, model = resolve(req.model)
    tokenizer = open_tokenizer(model.path)
    style = tools.check(key, tokenizer.template) if uses_tools(req) else None
    if req.tools and req.format is not None:
        raise bad(f"{req.format.where} holds the whole answer to JSON, which leaves no way to call the tools "
                  "offered: send one or the other", param=req.format.where.strip("'"))
    ctx = context_length(model.config, engine_ctx)  # what the engine will have: --ctx within the model's
    if req.num_ctx is not None:
        if req.num_ctx > ctx:
            raise bad(f"num_ctx {req.num_ctx} is past the context {key} runs with here ({ctx} tokens; "
                      f"`nerva serve --ctx` sets it)", param="num_ctx")
        ctx = req.num_ctx
    ids = _prompt_ids(tokenizer, req, ctx)
    if not ids:
        raise bad("the prompt is empty", param="prompt")
    if len(ids) >= ctx:
        raise bad(f"the prompt takes {len(ids)} tokens and the context holds {ctx}: nothing is left for the "
                  f"answer (shorten the prompt or raise the context)", code="context_length_exceeded")
    if req.max_tokens is not None and req.max_tokens > ctx:
        raise bad(f"at most {req.max_tokens} tokens were asked for, past the context of {ctx} tokens",
                  param="max_tokens")
    room = ctx - len(ids)
    constraint = None
    # the format asked for, or the calls to the tools offered: against this model's tokens, a 400
    # before any token where it cannot be held to
    held = req.format
    if held is None and style and req.tools:
        callable_ = [t for t in req.tools if req.call in (None, "required", t["function"]["name"])]
        held = tools.held_calls(callable_, style, tokenizer, required=req.call is not None)
    if held is not None:
        from nerva_cli.structured.constraint import Constraint

        try:
            constraint = Constraint(held, tokenizer, model.config.vocab_size)
        except NervaError as e:
            raise bad(str(e), param=held.where.strip("'")) from None
    return key, model, tokenizer, ids, min(req.max_tokens or room, room), style, constraint


async def submit(state, req: GenRequest) -> Job:
    """The request queued on its model (loaded first where it is not); 4xx for what is wrong with
    it, 503 when the queue is full."""
    key, model, tokenizer, ids, max_tokens, style, constraint = await asyncio.to_thread(
        _prepare, req, state.options.engine.ctx)
    job = Job(key, ids, req.sampling, max_tokens, req.stops, req.keep_alive, tokenizer, state.metrics,
              asyncio.get_running_loop(), top_logprobs=req.top_logprobs, tool_style=style, constraint=constraint)
    state.registry.submit(job, model)
    return job


class ClientGone(ApiError):
    """The client disconnected before its answer ended (nginx's 499: nobody reads the response)."""

    def __init__(self):
        super().__init__(499, "the client closed the request")


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Listener:
    """A job's events for its handler: ("text", str) until ("done", Result); an error event is
    raised. While it watches the request, a client that disconnects cancels the job (ClientGone);
    a streamed answer stops watching once it streams (Starlette's StreamingResponse watches then)."""

    def __init__(self, state, job: Job, request: Request):
        self.registry, self.job = state.registry, job
        self.finished = False
        self.watching = True
        self.gone = asyncio.ensure_future(_disconnect(request))

    def stop_watching(self) -> None:
        self.watching = False
        self.gone.cancel()

    def cancel(self) -> None:
        """The answer is not wanted any more (a no-op once it ended)."""
        self.stop_watching()
        if not self.finished:
            self.finished = True
            self.registry.cancel(self.job)

    async def next(self) -> tuple[str, object]:
        if not self.watching:  # a stream after its first event (Starlette watches then): no task a token
            kind, payload = await self.job.events.get()
        else:  # (the client already gone: this returns at once)
            get = asyncio.ensure_future(self.job.events.get())
            await asyncio.wait({get, self.gone}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                self.cancel()
                raise ClientGone()
            kind, payload = await get
        if kind in ("done", "error"):
            self.finished = True
            self.stop_watching()
        if kind == "error":
            raise payload
        return kind, payload

    async def collect(self) -> tuple[str, object]:
        """The whole answer: (text, Result)."""
        parts = []
        while True:
            kind, payload = await self.next()
            if kind == "done":
                return "".join(parts), payload
            parts.append(payload)


async def whole_answer(state, job: Job, request: Request) -> tuple[str, object]:
    """-> (text, Result), the client watched all along."""
    return await Listener(state, job, request).collect()


async def streamed_answer(state, job: Job, request: Request):
    """-> an async iterator of the answer's events. The first has come when this returns, so
    that what fails before any text (the model's load, say) is the response's status, not a
    line inside a 200. The job is cancelled when the iterator is left early (client gone)."""
    listener = Listener(state, job, request)
    event = await listener.next()
    listener.stop_watching()

    async def events():
        nonlocal event
        try:
            while True:
                yield event
                if event[0] == "done":
                    return
                event = await listener.next()
        finally:
            listener.cancel()

    return events()
