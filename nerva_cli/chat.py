"""A conversation over one engine: renders the history with the chat template and reuses the
KV cache for the part of the token sequence that did not change since the last turn."""

from __future__ import annotations

from nerva_cli.generate import GenerationStats, generate
from nerva_cli.sampling import Sampler, SamplingOptions


class ChatSession:
    def __init__(self, engine, tokenizer, opts: SamplingOptions, max_tokens: int, raw: bool = False,
                 system: str | None = None, stops: list[str] = (), ledger=None):
        self.engine, self.tok, self.opts = engine, tokenizer, opts
        self.max_tokens, self.raw, self.stops = max_tokens, raw, list(stops)
        self.system = system
        self.ledger = ledger
        self.sampler = Sampler(opts, engine.cfg.vocab_size)
        self.clear()

    def clear(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.cached: list[int] = []  # the tokens whose K/V the engine holds, in order
        self.engine.reset()

    def _prompt_ids(self, user_text: str) -> list[int]:
        if self.raw:
            return self.cached + self.tok.encode(user_text, add_special=not self.cached)
        self.messages.append({"role": "user", "content": user_text})
        return self.tok.encode(self.tok.render_chat(self.messages, add_generation_prompt=True),
                               add_special=False)

    def answer(self, user_text: str, write) -> GenerationStats:
        ids = self._prompt_ids(user_text)
        common = 0
        for a, b in zip(self.cached, ids):
            if a != b:
                break
            common += 1
        common = min(common, len(ids) - 1)  # at least one token must be prefilled for logits
        self.engine.truncate(common)
        budget = self.engine.ctx - len(ids)
        if budget < 1:
            from nerva_cli.errors import NervaError

            raise NervaError(f"the conversation ({len(ids)} tokens) no longer fits the context "
                             f"({self.engine.ctx}); /clear it or raise --ctx")
        decoder = self.tok.stream_decoder()
        out, stats = generate(self.engine, ids[common:], self.sampler, min(self.max_tokens, budget),
                              eos_ids=self.tok.eos_ids, decoder=decoder, stops=self.stops, on_text=write,
                              ledger=self.ledger)
        # the engine has run every generated token but, when it stopped on length or a stop
        # string, the last one sampled
        self.cached = (ids + out)[: self.engine.n_past]
        if not self.raw:
            self.messages.append({"role": "assistant", "content": self.tok.decode(out)})
        stats.prompt_tokens = len(ids) - common
        return stats
