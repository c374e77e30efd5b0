"""A conversation held by a running `nerva serve`: what ChatSession is to an engine in this
process, over ollama's API, so that `nerva run` (its prompt and its chat, with their commands)
works the same either way while the server keeps the model loaded between runs."""

from __future__ import annotations

import time

from nerva_cli.runtime.chat import Conversation
from nerva_cli.runtime.generate import GenerationStats
from nerva_cli.runtime.sampling import SamplingOptions


class RemoteChat(Conversation):
    engine = None  # no engine in this process (the chat's /show info asks info_rows instead)

    def __init__(self, client, model: str, described: dict, opts: SamplingOptions, max_tokens: int,
                 raw: bool = False, system: str | None = None, stops: list[str] = (), fmt=None):
        """described: the server's /api/show of `model`; fmt: a JSON structured.Format (ollama's
        API takes JSON and schemas, no grammars)."""
        self.client, self.model, self.described = client, model, described
        self.format = fmt
        self.max_tokens, self.raw, self.stops = max_tokens, raw, list(stops)
        self.system = system
        self.opts = opts
        self.clear()

    @property
    def template(self) -> str | None:
        return None if self.raw else self.described.get("template") or None

    def set_options(self, opts: SamplingOptions) -> None:
        self.opts = opts

    def clear(self) -> None:
        super().clear()
        self.text = ""  # --raw: the conversation so far, as one text

    def _options(self) -> dict:
        o = self.opts
        options = {"temperature": o.temperature, "top_k": o.top_k, "top_p": o.top_p, "min_p": o.min_p,
                   "repeat_penalty": o.repeat_penalty, "repeat_last_n": o.repeat_last_n,
                   "num_predict": self.max_tokens}
        if o.seed is not None:
            options["seed"] = o.seed
        if self.stops:
            options["stop"] = self.stops
        return options

    def answer(self, user_text: str, write) -> GenerationStats:
        """As ChatSession.answer: the answer written as it comes, Ctrl-C stopping it (the
        connection closes, which cancels it on the server)."""
        if self.raw:
            path, body = "/api/generate", {"model": self.model, "prompt": self.text + user_text, "raw": True}
        else:
            messages = self.messages + [{"role": "user", "content": user_text}]
            # the oldest turns go where the conversation outgrows the context, as in this process
            path, body = "/api/chat", {"model": self.model, "messages": messages, "truncate": True}
        body["options"] = self._options()
        if self.format is not None:
            body["format"] = "json" if self.format.kind == "JSON" else self.format.schema
        stats, parts, last = GenerationStats(), [], None
        started = time.perf_counter()
        stream = self.client.stream(path, body)
        try:
            for line in stream:
                text = line["response"] if self.raw else line.get("message", {}).get("content", "")
                if not stats.ttft_s:
                    stats.ttft_s = time.perf_counter() - started
                if text:
                    parts.append(text)
                    write(text)
                if line.get("done"):
                    last = line
        except KeyboardInterrupt:
            stats.stop_reason = "interrupted"
            stats.cut_short = self.format is not None
        finally:
            stream.close()
        answer = "".join(parts)
        if last is not None:
            self._stats_from(last, stats)
        if self.raw:
            self.text = body["prompt"] + answer
        else:
            self.messages = messages + [{"role": "assistant", "content": answer}]
        return stats

    def _stats_from(self, done: dict, stats: GenerationStats) -> None:
        """The server's timings (ollama's fields, ns): a decode step's time is its average."""
        n = done.get("eval_count", 0)
        stats.prompt_tokens, stats.gen_tokens = done.get("prompt_eval_count", 0), n
        stats.prefill_s = done.get("prompt_eval_duration", 0) / 1e9
        if n > 1:
            stats.token_s = [done.get("eval_duration", 0) / 1e9 / (n - 1)] * (n - 1)
        reason = done.get("done_reason")
        stats.stop_reason = ("context" if reason == "length" and n < self.max_tokens else
                             "length" if reason == "length" else "stop")
        # the server ends a held answer on its own only where the grammar is complete
        stats.cut_short = self.format is not None and reason == "length"

    def context_note(self) -> str:
        return (f"the answer stopped at the end of the context the server runs {self.model} with "
                "(`nerva serve --ctx` sets it)")

    def info_rows(self, runtime: str) -> list[tuple[str, str]]:
        info = self.described.get("model_info", {})
        arch = info.get("general.architecture", "?")
        details = self.described.get("details", {})
        rows = [("model", self.model),
                ("architecture", f"{arch}, {info.get(f'{arch}.block_count', '?')} layers, hidden "
                                 f"{info.get(f'{arch}.embedding_length', '?')}, vocab {info.get(f'{arch}.vocab_size', '?')}"),
                ("parameters", details.get("parameter_size", "?")),
                ("quantization", details.get("quantization_level", "?")),
                ("backend", runtime)]
        if self.system:
            rows.append(("system", self.system))
        return rows
