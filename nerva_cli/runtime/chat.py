"""A conversation over one engine: renders the history with the chat template and reuses the
KV cache for the part of the token sequence that did not change since the last turn."""

from __future__ import annotations

from nerva_cli.errors import NervaError
from nerva_cli.runtime.generate import GenerationStats, generate, reusable_prefix
from nerva_cli.runtime.sampling import Sampler, SamplingOptions


def fit_turns(messages: list[dict], render, ctx: int, room: int) -> tuple[list[dict], list[int], int]:
    """Drops the oldest turns (a system message stays) until the rest, rendered to tokens by
    `render`, leave `room` positions of the context for the answer, as ollama does; the newest
    message alone may take more. -> (the messages kept, their tokens, turns dropped): the
    caller checks that the tokens fit at all."""
    messages = list(messages)
    first = 1 if messages[0]["role"] == "system" else 0
    dropped = 0
    ids = render(messages)
    while len(ids) > ctx - room and len(messages) - first > 1:
        del messages[first]  # a whole turn, so that roles still alternate as templates demand
        while len(messages) - first > 1 and messages[first]["role"] != "user":
            del messages[first]
        dropped += 1
        ids = render(messages)
    return messages, ids, dropped


class Conversation:
    """The messages of a chat and its system message, whoever runs it (ChatSession here, a
    server's RemoteChat)."""

    system: str | None = None
    format = None  # structured.Format every answer is held to, or None

    def cut_short_note(self, stats: GenerationStats) -> str:
        """What an answer cut before its grammar was complete is: not the format asked for."""
        why = {"context": "the end of the context (--ctx sets a longer one)", "interrupted": "Ctrl-C"}.get(
            stats.stop_reason, f"--max-tokens ({self.max_tokens})")
        return f"the answer stopped at {why} before its {self.format.kind} was complete: it is not valid output"

    def set_system(self, text: str | None) -> None:
        """The system message from the next turn on; the conversation so far stays."""
        self.system = text
        if self.messages and self.messages[0]["role"] == "system":
            self.messages.pop(0)
        if text:
            self.messages.insert(0, {"role": "system", "content": text})

    def clear(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []


class ChatSession(Conversation):
    def __init__(self, engine, tokenizer, opts: SamplingOptions, max_tokens: int, raw: bool = False,
                 system: str | None = None, stops: list[str] = (), ledger=None, note=None, fmt=None):
        self.engine, self.tok = engine, tokenizer
        self.max_tokens, self.raw, self.stops = max_tokens, raw, list(stops)
        self.format = fmt  # structured.Format every answer is held to, or None
        self.system = system
        self.ledger = ledger
        self.note = note  # told, in one line, when old turns are dropped to fit the context
        self.set_options(opts)
        self.clear()

    @property
    def template(self) -> str | None:
        """The chat template the messages go through; None where they go as they are (--raw)."""
        return None if self.raw else self.tok.template

    def set_options(self, opts: SamplingOptions) -> None:
        self.opts = opts
        self.sampler = Sampler(opts, self.engine.cfg.vocab_size)

    def clear(self) -> None:
        super().clear()
        self.cached: list[int] = []  # the tokens whose K/V the engine holds, in order
        self.engine.reset()

    def _render(self, messages: list[dict]) -> list[int]:
        return self.tok.encode(self.tok.render_chat(messages, add_generation_prompt=True), add_special=False)

    def _prompt_ids(self, user_text: str) -> list[int]:
        """The whole conversation's tokens with `user_text` as the last message. Where it leaves
        less room for the answer than min(--max-tokens, a quarter of the context), the oldest
        turns are dropped, as ollama does (the system message stays); the newest message alone
        may take all but one position. Raises, the conversation unchanged, if it cannot fit."""
        ctx = self.engine.ctx
        if self.raw:
            ids = self.cached + self.tok.encode(user_text, add_special=not self.cached)
            if len(ids) >= ctx:
                raise NervaError(f"the conversation ({len(ids)} tokens) no longer fits the context ({ctx}); "
                                 f"/clear it or raise --ctx" if self.cached else
                                 f"the prompt takes {len(ids)} tokens and the context holds {ctx}: raise --ctx")
            return ids
        messages = self.messages + [{"role": "user", "content": user_text}]
        messages, ids, dropped = fit_turns(messages, self._render, ctx, min(self.max_tokens, max(1, ctx // 4)))
        if len(ids) >= ctx:
            raise NervaError(f"the message takes {len(ids)} tokens with the chat template and the context holds "
                             f"{ctx}: raise --ctx")
        if dropped and self.note:
            self.note(f"dropped the {dropped} oldest turn(s) so the conversation fits the context ({ctx})")
        self.messages = messages
        return ids

    def answer(self, user_text: str, write) -> GenerationStats:
        constraint = None
        if self.format is not None:  # each answer starts the grammar again
            from nerva_cli.structured.constraint import Constraint

            constraint = Constraint(self.format, self.tok, self.engine.cfg.vocab_size)
        self.sampler.hold_to(constraint)
        ids = self._prompt_ids(user_text)
        common = self.engine.truncate(reusable_prefix(self.cached, ids))
        decoder = self.tok.stream_decoder()
        room = self.engine.ctx - len(ids)
        out, stats = generate(self.engine, ids[common:], self.sampler, min(self.max_tokens, room),
                              eos_ids=self.tok.eos_ids, decoder=decoder, stops=self.stops, on_text=write,
                              ledger=self.ledger)
        if stats.stop_reason == "length" and len(out) == room < self.max_tokens:
            stats.stop_reason = "context"  # not --max-tokens, and the caller says so (context_note)
        # the engine has run every generated token but, when it stopped on length or a stop
        # string, the last one sampled
        self.cached = (ids + out)[: self.engine.n_past]
        if not self.raw:
            self.messages.append({"role": "assistant", "content": self.tok.decode(out)})
        stats.prompt_tokens = len(ids) - common
        return stats

    def context_note(self) -> str:
        """The note after an answer the context cut short (stop_reason "context"), which would
        otherwise look finished or like --max-tokens' cut."""
        return f"the answer stopped at the end of the context ({self.engine.ctx} tokens); --ctx sets a longer one"
