"""The host sampler (sampling.Sampler, its numba work in planes/cpu/kernels) against
ref.sampling_candidates and NumPy, on fresh random logits."""

from __future__ import annotations

import numpy as np
import pytest

from nerva_cli.planes import ref
from nerva_cli.errors import NervaError
from nerva_cli.runtime.hotpath import AllocationCounter
from nerva_cli.runtime.sampling import Sampler, SamplingOptions
from test_kernels import randn

# case: vocab, top_k, temperature, logit scale, the kept set's size about (top_p midway between two
# running masses of the candidates; None: top_p 1), the ties planted, and the size min_p keeps of
# that (midway between two weights, in their logarithms; None: min_p 0)
CASES = {
    "top_k_top_p": (49152, 40, 0.8, 2.0, 12, None, None),
    "top_k_alone": (49152, 40, 0.7, 2.0, None, None, None),
    "kth_ties": (5000, 40, 0.8, 2.0, None, "kth", None),  # the 35th to 44th largest share one value
    "top_ties": (5000, 40, 0.8, 2.0, 12, "top", None),  # 1500 share the largest: all candidates
    "top_p_alone": (3000, 0, 1.5, 2.0, 12, None, None),  # a heap over the whole vocabulary, popped a little
    "top_p_wide": (3000, 0, 1.0, 0.05, 2000, None, None),  # nearly flat: most of it popped
    "temperature_alone": (3000, 0, 1.5, 2.0, None, None, None),
    "top_k_min_p": (49152, 40, 0.8, 2.0, None, None, 8),  # min-p within top-k: token order
    "top_p_then_min_p": (3000, 0, 1.5, 2.0, 30, None, 10),  # min-p cuts below top-p's cut
    "min_p_past_top_p": (49152, 40, 0.8, 2.0, 12, None, 11),  # the pop stops at min-p, before top-p's cut
    "min_p_alone": (3000, 0, 1.5, 2.0, None, None, 25),
}


def between_weights(w, size):
    """A min_p that keeps the `size` largest of the weights w, midway between two of them."""
    w = np.sort(w)[::-1]
    j = min(len(w) - 1, size)
    return float(np.sqrt(w[j - 1] * w[j]))


def planted(rng, vocab, scale, ties):
    logits = randn(rng, vocab) * np.float32(scale)
    if ties == "kth":
        order = np.argsort(-logits, kind="stable")
        logits[order[34:44]] = logits[order[39]]
    elif ties == "top":
        logits[rng.choice(vocab, 1500, replace=False)] = logits.max() + 1.0
    return logits


@pytest.mark.parametrize("case", list(CASES))
def test_a_draw_is_the_inverse_cdf_of_its_uniform(rng, case):
    """Each draw recomputed from the sampler's own uniform (a generator seeded alike): the kept
    token whose range of the kept weight holds it, in value order when top_p < 1 and token order
    otherwise. Draws within 1e-9 of a range boundary are skipped (sums in another order may round
    either way there); top_p lies midway between two running masses, far from a cut."""
    vocab, top_k, temperature, scale, size, ties, min_size = CASES[case]
    logits = planted(rng, vocab, scale, ties)
    top_p = 1.0
    if size is not None:
        _, w = ref.sampling_candidates(logits, temperature, top_k, 1.0)
        c = np.cumsum(w) / w.sum()
        j = min(len(c) - 2, size)
        top_p = float((c[j] + c[j + 1]) / 2)
    kept, w = ref.sampling_candidates(logits, temperature, top_k, top_p)
    min_p = 0.0 if min_size is None else between_weights(w, min_size)
    kept, w = ref.sampling_candidates(logits, temperature, top_k, top_p, min_p)
    if ties == "kth":
        assert len(kept) == 44  # the tie across the k-th place is kept whole
    if min_size is not None:
        assert len(kept) == min_size
    if top_p == 1.0:
        w, kept = w[np.argsort(kept)], np.sort(kept)
    bounds = np.cumsum(w) / w.sum()
    seed = int(rng.integers(1 << 31))
    sampler = Sampler(SamplingOptions(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed),
                      vocab)
    uniforms = np.random.default_rng(seed)
    checked, drawn = 0, set()
    for draw in range(40):
        token = sampler(logits)
        u = uniforms.random()
        drawn.add(token)
        if np.min(np.abs(bounds - u)) < 1e-9:
            continue
        assert token == kept[np.searchsorted(bounds, u, side="right")], f"draw {draw}"
        checked += 1
    assert checked >= 36
    assert len(drawn) > 1


def test_greedy_is_argmax_lowest_index_on_ties(rng):
    logits = randn(rng, 1000)
    logits[[400, 17]] = logits.max() + 1.0
    assert Sampler(SamplingOptions(temperature=0.0), 1000)(logits) == 17
    assert Sampler(SamplingOptions(temperature=1.5, top_k=1, top_p=1.0, seed=3), 1000)(logits) == 17


def test_repetition_penalty_once_per_recent_token(rng):
    """llama.cpp's rule over the last repeat_last_n sampled tokens (the ring wrapped twice,
    with repeats), in float32 as NumPy computes it; tokens older than the window untouched."""
    vocab, last_n, penalty = 300, 16, 1.3
    logits = randn(rng, vocab) * np.float32(3)
    sampler = Sampler(SamplingOptions(temperature=0.0, repeat_penalty=penalty, repeat_last_n=last_n), vocab)
    history = rng.integers(0, vocab, 40)
    for t in history:
        sampler.remember(int(t))
    want = logits.copy()
    p = np.float32(penalty)
    for t in set(history[-last_n:].tolist()):
        want[t] = want[t] / p if want[t] > 0 else want[t] * p
    got = sampler.penalised(logits)
    np.testing.assert_array_equal(got, want)
    assert sampler(logits) == int(np.argmax(want))
    np.testing.assert_array_equal(sampler.penalised(logits), sampler.penalised(logits))  # its flags reset


def test_a_seed_repeats_its_tokens(rng):
    logits = randn(rng, 5000) * np.float32(0.5)
    opts = SamplingOptions(temperature=1.0, top_k=0, top_p=0.9, repeat_penalty=1.1, seed=11)
    first, again = Sampler(opts, 5000), Sampler(opts, 5000)
    runs = [[first(logits) for _ in range(30)], [again(logits) for _ in range(30)]]
    assert runs[0] == runs[1]
    other = Sampler(SamplingOptions(temperature=1.0, top_k=0, top_p=0.9, repeat_penalty=1.1, seed=12), 5000)
    assert [other(logits) for _ in range(30)] != runs[0]  # thousands of candidates: never equal by chance


def test_sampling_allocates_nothing(rng):
    """The default options and a penalty, SmolLM2's vocabulary: after the first call (numba loads
    its machine code), no step grows traced memory by more than hotpath's slack."""
    vocab = 49152
    logits = randn(rng, vocab) * np.float32(2)
    sampler = Sampler(SamplingOptions(repeat_penalty=1.2, seed=int(rng.integers(1 << 31))), vocab)
    sampler(logits)
    with AllocationCounter() as counter:
        for _ in range(20):
            with counter.step():
                sampler(logits)
    assert counter.steps == 20 and counter.count == 0


def test_negative_repeat_window_is_refused():
    with pytest.raises(NervaError, match="--repeat-last-n must be >= 0"):
        SamplingOptions(repeat_last_n=-1)
