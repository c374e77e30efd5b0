"""One answer's grammar state: before each token, the tokens the grammar allows next, applied to
the logits (the rest become -inf) before the sampler's penalty, temperature and truncation; after
it, the token taken. Greedy and seeded draws stay deterministic: the mask depends only on the
tokens taken so far."""

from __future__ import annotations

from time import perf_counter_ns

import numpy as np

from nerva_cli.errors import BadInput, NervaError
from nerva_cli.structured.formats import Format


def grammar_tokenizer(tokenizer, vocab: int):
    """llguidance's view of a model's tokenizer (every token's bytes, its ends of sequence), built
    once per tokenizer and vocabulary: 0.5 s for SmolLM2's 49k tokens, about 2 s for 150k."""
    import llguidance

    built = tokenizer.__dict__.setdefault("_grammar_tokenizers", {})
    if vocab not in built:
        built[vocab] = llguidance.LLTokenizer(tokenizer.tok.to_str(), n_vocab=_tokens(tokenizer, vocab),
                                              eos_token=sorted(tokenizer.eos_ids) or None)
    return built[vocab]


def _tokens(tokenizer, vocab: int) -> int:
    """The tokens a mask covers: the model's logits, or the tokenizer's ids where it has more
    (those past the logits are never sampled)."""
    return max(vocab, tokenizer.tok.get_vocab_size(with_added_tokens=True))


class Constraint:
    """`fmt` held to over one answer of a model whose logits have `vocab` entries."""

    def __init__(self, fmt: Format, tokenizer, vocab: int):
        import llguidance

        self.format = fmt
        self.matcher = llguidance.LLMatcher(grammar_tokenizer(tokenizer, vocab), fmt.grammar, log_level=0)
        if self.matcher.is_error():
            raise BadInput(f"{fmt.where}: the {fmt.kind} cannot be held to with this model's tokens: "
                           f"{' '.join(self.matcher.get_error().split())}")
        words = (_tokens(tokenizer, vocab) + 31) // 32
        self.allowed = np.zeros(words, np.uint32)  # bit t % 32 of word t // 32: token t may come next
        self._allowed_at = self.allowed.ctypes.data  # its address, for llguidance to write into
        self.mask_ns = 0  # the last mask's time (the ledger's column)
        self.mask_ns_total, self.masks = 0, 0  # all of them (bench's mean)
        from nerva_cli.planes.cpu.kernels import sampling

        self._allow_only = sampling.allow_only

    def apply(self, logits: np.ndarray, out: np.ndarray) -> np.ndarray:
        """out = logits where the grammar allows the token next, -inf elsewhere (out may be logits)."""
        t0 = perf_counter_ns()
        self.matcher.unsafe_compute_mask_ptr(self._allowed_at, self.allowed.nbytes)
        if self.matcher.is_error():
            raise NervaError(f"structured output ({self.format.describe()}): {self.matcher.get_error()}")
        self._allow_only(logits, self.allowed, out)
        self.mask_ns = perf_counter_ns() - t0
        self.mask_ns_total += self.mask_ns
        self.masks += 1
        return out

    def take(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise NervaError(f"structured output ({self.format.describe()}): token {token} was sampled against "
                             f"the grammar: {self.matcher.get_error()}")

    @property
    def complete(self) -> bool:
        """The answer so far matches the whole grammar (an end of sequence may come now)."""
        return self.matcher.is_accepting()
