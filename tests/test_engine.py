"""The decode engine against HF transformers (float32) on tiny random models of every family."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from conftest import hf_greedy
from test_kernels import SPLIT_ERROR
from nerva_cli.planes.cpu.engine import Engine
from nerva_cli.planes.cpu.kernels import (  # the kernels' modules: settings the contract does not expose
    prefill_attention as cpu_prefill_attention, gemm as cpu_gemm, target as cpu_target)
from nerva_cli.store.pull import pull
from nerva_cli.model.quant import dequantize_q4

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPT = [5, 17, 99, 3, 250, 11, 42, 7, 300, 12]
N_TOKENS = 64
# Both sides compute in float32 from identical weights (the HF model's matrices are rounded to
# f16 exactly as the f16 variant stores them); what differs is summation order (BLAS blocking,
# per-head loops), worth ~sqrt(K) * 6e-8 relative per dot product for K <= 160, compounded over
# 3 layers and 74 positions: measured 4e-7 to 6e-7. 1e-4 leaves room for that and would still
# catch any real error (a wrong rope pair, a missing bias or norm gives O(1)). These tests run the
# f32 KV cache, which computes what transformers does; the default f16 cache rounds each cached
# value once more (test_f16_kv_cache_follows_transformers holds it to its own bound).
LOGIT_RTOL = 1e-4
# W4A16 where the cpu rounds its activations: in bf16 dot products (AVX512-BF16) each is split
# into two bf16 parts, 16 significant bits, rounded at most 2^-16 relative (32 times finer than
# an f16 activation); without AVX-512F each becomes a Q16 code, rounded at most 2^-16 of its
# 32-group's largest value. Every matvec's input carries that. Measured against exact-activation
# logits (ref's decode against the cpu's prefill, test_q4_decode_matches_prefill_and_ref's
# sequences, 8 seeds), bf16: 4.5e-5 to 1.3e-4; against transformers (the q4_1 test below) bf16
# 2.5e-4, Q16 3.5e-4. Q16 is coarser where a group holds an outlier: over 6 such sequences per
# family and variant (Zen 3), at most 5.3e-4 for llama and qwen2, 8.1e-4 for gemma3, 1.8e-3 for
# gemma2 (these models' weights are wide, std 0.25); SmolLM2 q4_1's decode against ref's f32
# activations 6.2e-5 median, 1.4e-4 at most over 16 positions. So 1e-3 with bf16, 3e-3 with
# Q16: a wiring fault still moves logits by their own size.
W4A16_RTOL = 1e-3 if cpu_target._AVX512BF16 else 3e-3 if not cpu_target._AVX512F else LOGIT_RTOL


def hf_model(src):
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.copy_(p.half().float())
    return model.eval()


def rel_err(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("family,backend", [  # cpu on every family; the slow ref on some
    (f, "cpu") for f in ("llama", "llama-untied", "llama3-scaled", "qwen2", "qwen3", "qwen3-yarn", "phi3",
                         "phi3-longrope", "smollm3", "granite", "gemma", "gemma2", "gemma2-qpas", "gemma3", "gemma3-qpas")] + [
    ("qwen3", "ref"), ("llama3-scaled", "ref"), ("phi3-longrope", "ref"), ("gemma", "ref"), ("gemma2", "ref"),
    ("gemma3", "ref")])
def test_f16_greedy_and_logits_equal_transformers(family, backend, tiny_models, tmp_path):
    src = tiny_models(family)
    model = pull(str(src), variant="f16", out=tmp_path / "m")
    engine = Engine(model, backend=backend, ctx=256, kv_cache="f32")
    hf = hf_model(src)
    want = hf_greedy(hf, PROMPT, N_TOKENS)
    with torch.no_grad():  # logits over the whole sequence, to compare every step, not just argmax
        hf_logits = hf(torch.tensor([want])).logits[0].numpy()
    got_tokens = []
    logits = engine.prefill(PROMPT)
    assert rel_err(logits, hf_logits[len(PROMPT) - 1]) < LOGIT_RTOL
    for step in range(N_TOKENS):
        token = int(np.argmax(logits))
        got_tokens.append(token)
        logits = engine.decode(want[len(PROMPT) + step])  # follow HF's tokens: compare each step
        assert rel_err(logits, hf_logits[len(PROMPT) + step]) < LOGIT_RTOL, step
    assert got_tokens == want[len(PROMPT):]
    assert len(set(got_tokens)) > 10  # the test model is not stuck on one token


@pytest.mark.parametrize("backend", ["cpu", "ref"])
def test_gemma3_sliding_caches_follow_transformers_past_their_rows(backend, tiny_models, tmp_path, monkeypatch):
    """A sliding-window layer's cache holds its window, a prompt chunk and ROLLBACK positions
    (arena.cache_rows), the positions it attends over moved to the front when the rows run out
    (Engine._make_room). With ROLLBACK 4 and chunks of 4, the five windowed layers of the tiny
    Gemma 3 hold 16 rows and move them every few tokens over a 10-token prompt and 100 steps:
    the logits stay transformers' (LOGIT_RTOL, as above), and truncating keeps what the window
    still holds, all of it past that."""
    from nerva_cli.residency import arena

    monkeypatch.setattr(arena, "ROLLBACK", 4)
    src = tiny_models("gemma3")
    model = pull(str(src), variant="f16", out=tmp_path / "m")
    engine = Engine(model, backend=backend, ctx=256, kv_cache="f32", prefill_rows=4)
    assert engine.ring == [0, 1, 2, 3, 4] and [c.shape[0] for c in engine.a.k_cache] == [16] * 5 + [256]
    hf = hf_model(src)
    want = hf_greedy(hf, PROMPT, 100)
    with torch.no_grad():
        hf_logits = hf(torch.tensor([want])).logits[0].numpy()
    logits = engine.prefill(PROMPT)
    assert rel_err(logits, hf_logits[len(PROMPT) - 1]) < LOGIT_RTOL
    for step in range(100):
        logits = engine.decode(want[len(PROMPT) + step])
        assert rel_err(logits, hf_logits[len(PROMPT) + step]) < LOGIT_RTOL, step
    assert engine.kv_base > 0
    kept = engine.truncate(engine.n_past - 5)  # 5 <= ROLLBACK + 1 positions back: the window is still held
    assert kept == len(want) - 5 and rel_err(engine.prefill(want[kept:kept + 3]), hf_logits[kept + 2]) < LOGIT_RTOL
    assert engine.truncate(20) == 0 and engine.n_past == engine.kv_base == 0  # its window long overwritten
    assert rel_err(engine.prefill(want[:30]), hf_logits[29]) < LOGIT_RTOL


HF_MATRICES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
               "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_f16_kv_cache_follows_transformers(family, tiny_models, tmp_path):
    """The default f16 KV cache: each cached value rounded once (2^-11 relative), which attention
    averages over. Fed transformers' greedy tokens for 64 steps, the logits stay within 1e-2 of
    its float32 ones (measured: at most 4.1e-3 on llama, 1.0e-3 on qwen3) and the argmax is
    transformers' except where its two best logits are closer than twice the largest difference;
    the cache holds half the bytes of the f32 one."""
    src = tiny_models(family)
    model = pull(str(src), variant="f16", out=tmp_path / "m")
    engine, exact = Engine(model, ctx=256), Engine(model, ctx=256, kv_cache="f32")
    assert engine.kv_cache == "f16" and 2 * engine.a.kv_bytes == exact.a.kv_bytes
    assert engine.a.k_cache[0].dtype == np.float16
    hf = hf_model(src)
    want = hf_greedy(hf, PROMPT, N_TOKENS)
    with torch.no_grad():
        hf_logits = hf(torch.tensor([want])).logits[0].numpy()
    logits, errs, near_ties = engine.prefill(PROMPT), [], 0
    for step in range(N_TOKENS + 1):
        ref = hf_logits[len(PROMPT) - 1 + step]
        errs.append(rel_err(logits, ref))
        if int(np.argmax(logits)) != int(np.argmax(ref)):
            top2 = np.sort(ref)[-2:]
            assert top2[1] - top2[0] < 2 * np.abs(logits - ref).max(), step
            near_ties += 1
        if step < N_TOKENS:
            logits = engine.decode(want[len(PROMPT) + step])
    print("f16 cache: largest logit error", max(errs), "near ties", near_ties)
    assert max(errs) < 1e-2 and near_ties <= 2, (errs, near_ties)


def hf_on_stored_weights(src, model):
    """transformers' model of src running the weights the store holds: every quantised matrix
    decoded from its planes by the gguf package's own dequantisers (Q4_0 d (q - 8), Q4_1 d q + m,
    Q8_0 d q; f32), not nerva's, and every matrix kept exact (f16) widened as it is."""
    from gguf import GGMLQuantizationType, quants

    from nerva_cli.model.quant import join_blocks

    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()

    def weights(tensors, name):
        if f"{name}.q8" in tensors:
            raw, kind = join_blocks(tensors[f"{name}.q8"], tensors[f"{name}.d"]), GGMLQuantizationType.Q8_0
        elif f"{name}.m" in tensors:
            raw, kind = join_blocks(tensors[f"{name}.qs"], tensors[f"{name}.d"], tensors[f"{name}.m"]), \
                GGMLQuantizationType.Q4_1
        elif f"{name}.qs" in tensors:
            raw, kind = join_blocks(tensors[f"{name}.qs"], tensors[f"{name}.d"]), GGMLQuantizationType.Q4_0
        else:
            return torch.from_numpy(tensors[name].astype(np.float32))
        return torch.from_numpy(quants.dequantize(raw, kind).astype(np.float32))

    params = dict(hf.named_parameters())
    with torch.no_grad():
        for fname, name, hf_name in (("embed.bin", "embed", "model.embed_tokens"), ("lm_head.bin", "lm_head", "lm_head")):
            if fname in model.meta["files"]:
                params[f"{hf_name}.weight"].copy_(weights(model.read_file(fname), name))
        for i in range(model.config.num_layers):
            t = model.read_file(f"layer_{i:03d}.bin")
            for name, hf_name in HF_MATRICES.items():
                params[f"model.layers.{i}.{hf_name}.weight"].copy_(weights(t, name))
    return hf


def errors_against(hf, engine, steps: int = N_TOKENS):
    """The engine fed transformers' greedy tokens: -> (each step's logits error against
    transformers', the engine's own argmax at each step, transformers' continuation)."""
    want = hf_greedy(hf, PROMPT, steps)
    with torch.no_grad():
        hf_logits = hf(torch.tensor([want])).logits[0].numpy()
    logits = engine.prefill(PROMPT)
    errs, got_tokens = [rel_err(logits, hf_logits[len(PROMPT) - 1])], []
    for step in range(steps):
        got_tokens.append(int(np.argmax(logits)))
        logits = engine.decode(want[len(PROMPT) + step])
        errs.append(rel_err(logits, hf_logits[len(PROMPT) + step]))
    return errs, got_tokens, want[len(PROMPT):]


@pytest.mark.parametrize("precision", ["w4a16", "w4a8"])
def test_q4_1_logits_equal_transformers_on_its_weights(precision, tiny_models, tmp_path):
    """A q4_1 model against transformers running the same weights (hf_on_stored_weights). W4A16
    sums d q x and m x apart: the same f32 noise as the f16 test, so its tolerance, and the same
    greedy tokens. W4A8 rounds activations to int8, so it is held to the few-percent band
    test_q4_0_w4a8_differs_from_w4a16_but_little measures."""
    src = tiny_models("llama-untied")
    model = pull(str(src), variant="q4_1", out=tmp_path / "m")
    engine = Engine(model, precision=precision, ctx=256, kv_cache="f32")
    errs, got_tokens, want = errors_against(hf_on_stored_weights(src, model), engine)
    if precision == "w4a16":
        assert max(errs) < W4A16_RTOL, errs
        assert got_tokens == want
    else:
        assert 0.001 < max(errs) < 0.2, errs


# of the 22 matrices (7 a layer and the tied token table), qwen3-hd48 has o's rows 144 wide (3
# heads of 48) in each of its 3 layers; qwen3-h80 has q, k, v, gate and up's rows 80 wide, and the
# token table's
KEPT_EXACT = {"qwen3-hd48": ("3 of 22 matrices", ["o"]),
              "qwen3-h80": ("16 of 22 matrices", ["q", "k", "v", "gate", "up"])}


@pytest.mark.parametrize("family", sorted(KEPT_EXACT))
@pytest.mark.parametrize("backend,precision", [("cpu", "w4a16"), ("cpu", "w4a8"), ("ref", "w4a16"), ("ref", "w4a8")])
def test_q4_0_keeps_matrices_of_partial_blocks_exact(family, backend, precision, tiny_models, tmp_path):
    """A matrix whose rows are not whole Q4_0 blocks of 32 stays f16 in a q4_0 model, as
    llama.cpp's quantiser falls back for it, and the conversion says how many did; every other
    matrix is Q4_0 (the token table Q8_0). Each plane runs each matrix by its own format, inside
    one layer: the logits are transformers' on the stored weights to the q4_1 test's bounds
    (W4A16: its tolerance and the same greedy tokens, measured 1.8e-6 on qwen3-h80 and 2.8e-5 on
    qwen3-hd48; W4A8, whose activations are rounded to int8 only where they meet a Q4_0 matrix,
    the q4_1 test's band: measured 2.3e-2 and 4.3e-2). The cpu plane runs such a layer in its
    compiled halves, as any other."""
    src = tiny_models(family)
    notes = []
    model = pull(str(src), variant="q4_0", out=tmp_path / "m", notes=notes)
    count, exact = KEPT_EXACT[family]
    assert any(count in n and "F16" in n and "multiple of 32" in n for n in notes), notes
    layer = model.meta["files"]["layer_000.bin"]["tensors"]
    for name in HF_MATRICES:
        assert (layer[name]["dtype"] == "f16") if name in exact else (layer[f"{name}.qs"]["dtype"] == "u8"), name
    table = model.meta["files"]["embed.bin"]["tensors"]
    assert ("embed" in table) == (family == "qwen3-h80") != ("embed.q8" in table)
    engine = Engine(model, backend=backend, precision=precision, ctx=256, kv_cache="f32")
    assert len(engine.compiled_layers) == (model.config.num_layers if backend == "cpu" else 0)
    errs, got_tokens, want = errors_against(hf_on_stored_weights(src, model), engine)
    print(family, backend, precision, "largest logit error", max(errs))
    if precision == "w4a16":
        assert max(errs) < W4A16_RTOL, errs
        assert got_tokens == want
    else:
        assert 0.001 < max(errs) < 0.2, errs


@pytest.mark.parametrize("family", ["qwen2", "gemma2", "gemma3"])  # gemma: chunks start inside the 8-position window
def test_prefill_in_chunks_equals_one_chunk(family, tiny_models, tmp_path, rng):
    model = pull(str(tiny_models(family)), variant="f16", out=tmp_path / "m")
    ids = list(rng.integers(0, 384, size=40))
    # the f32 cache: with f16, a K value that f32 noise moves across an f16 rounding boundary
    # would move the logits by up to 2^-11 of its share, past this bound
    whole = Engine(model, ctx=128, kv_cache="f32").prefill(ids, all_logits=True)
    engine = Engine(model, ctx=128, kv_cache="f32", prefill_rows=7)
    assert engine.prefill_chunk == 7
    chunked = engine.prefill(ids, all_logits=True)
    assert rel_err(chunked, whole) < 1e-5  # same math; only BLAS blocking differs


@pytest.mark.parametrize("variant,precision", [("q4_0", "w4a16"), ("q4_1", "w4a16"), ("f16", None)])
def test_prefill_dequantises_in_slices_of_rows(variant, precision, tiny_models, tmp_path, monkeypatch, rng):
    """A scratch of one down row (160 floats) makes every matrix, lm_head's Q8_0 table too, go
    through the GEMM in slices of one row (on two threads, a row each where it holds two): the
    logits are those of whole-matrix GEMMs, to f32 noise (only BLAS blocking differs; measured
    ~1e-6). W4A8 is left out: its activations are quantised before the slicing, and an
    activation that f32 noise moves across an int8 code boundary moved the logits by 4.5e-4 in
    one CI run."""
    from nerva_cli.residency import arena

    model = pull(str(tiny_models("llama-untied")), variant=variant, out=tmp_path / "m")
    ids = [int(t) for t in rng.integers(0, 384, size=20)]
    # the f32 cache: with f16, a K value that f32 noise moves across an f16 rounding boundary
    # would move the logits by up to 2^-11 of its share, past this bound
    whole = Engine(model, precision=precision, ctx=64, kv_cache="f32").prefill(ids, all_logits=True)
    monkeypatch.setattr(arena, "DEQUANT_SLICE_BYTES", 4)
    engine = Engine(model, precision=precision, ctx=64, kv_cache="f32")
    assert engine.pw.bufs["dequant"].size == model.config.intermediate_size == 160
    assert rel_err(engine.prefill(ids, all_logits=True), whole) < 1e-5


@pytest.mark.parametrize("variant,precision", [("q4_1", "w4a16"), ("f16", None)])
def test_prefill_without_numpys_openblas(variant, precision, tiny_models, tmp_path, monkeypatch, rng):
    """Where NumPy has another BLAS (no cblas_sgemm of its wheels' OpenBLAS to call from numba's
    threads), prefill's GEMMs take NumPy's matmul slice by slice and its attention ref's: the
    logits are those of the threaded path, to f32 noise (the GEMMs' blocking and attention's
    order of sums differ)."""
    model = pull(str(tiny_models("qwen3")), variant=variant, out=tmp_path / "m")
    ids = [int(t) for t in rng.integers(0, 384, size=90)]  # past the short-prompt kernels
    want = Engine(model, precision=precision, ctx=128, kv_cache="f32").prefill(ids, all_logits=True)
    monkeypatch.setattr(cpu_gemm, "_SGEMM", 0)  # the GEMMs'
    monkeypatch.setattr(cpu_prefill_attention, "_SGEMM", 0)  # and the attention's
    got = Engine(model, precision=precision, ctx=128, kv_cache="f32").prefill(ids, all_logits=True)
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("family,variant,precision", [
    ("qwen2", "q4_0", "w4a8"), ("qwen3", "q4_1", "w4a16"), ("llama-untied", "f16", None),
    ("gemma3", "q4_0", "w4a16")])
def test_prefill_allocates_only_its_logits(family, variant, precision, tiny_models, tmp_path, rng):
    """Every buffer a prompt needs is in the workspace the plan counts: over a prompt of three
    128-token chunks, traced memory rises by the logits row prefill returns and at most 8 KiB
    more, under the smallest buffer a chunk needs (its K rows, 16 KiB); the views and argument
    tuples of a layer's calls measured 5.5 KiB at once. The f16 cache, so K and V are widened in
    the workspace too."""
    from nerva_cli.residency.arena import PrefillWorkspace

    model = pull(str(tiny_models(family)), variant=variant, out=tmp_path / "m")
    engine = Engine(model, precision=precision, ctx=400, prefill_rows=128)
    assert engine.pw.nbytes == PrefillWorkspace.size(model.config, 128, 400)
    ids = [int(t) for t in rng.integers(0, 384, size=300)]
    for _ in range(2):  # numba's first calls; then one-time entries in NumPy's and numba's caches
        engine.prefill(ids)
        engine.reset()
    tracemalloc.start()
    try:
        start, _ = tracemalloc.get_traced_memory()
        engine.prefill(ids)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    logits = 4 * model.config.vocab_size
    assert 128 * model.config.kv_dim * 4 >= 16 << 10
    assert logits <= peak - start <= logits + (8 << 10)


@pytest.mark.parametrize("family,variant", [("llama", "q4_0"), ("llama", "q4_1"), ("gemma2", "q4_0"),
                                            ("gemma3", "q4_1")])
@pytest.mark.parametrize("precision", ["w4a16", "w4a8"])
def test_q4_decode_matches_prefill_and_ref(precision, family, variant, tiny_models, tmp_path, rng):
    """Decode (integer W4A8 / float W4A16 kernels) and prefill (dequantise + GEMM) are two
    implementations of the same numerics: the logits of the same positions agree, over three
    random 24-token sequences.

    f32 summation order differs (per-block combine vs GEMM): ~1e-6 relative, so 1e-4 (where the
    cpu's W4A16 multiplies in bf16, W4A16_RTOL: a short prefill takes those kernels). W4A8 adds
    a discrete step: an activation within f32 noise of a rounding boundary lands on the other
    int8 code in one path, which moves that position's logits by a few percent and, through
    the KV cache, the positions after it. Over 6000 seeded sequences, each decoded on both
    backends (12000 runs of this test's loop body): the largest error 4.9%, 88 runs (0.7%) above
    3% (this test's old bound, and its flake), none above 5%; 36 runs (0.3%) flipped at the
    first position, so no position agreed to f32 noise. So W4A8 must agree to f32 noise
    somewhere in the three (all three flipping there: about 1e-7) and to 1e-1 everywhere (a
    wiring fault moves logits by their own size); the W4A8 kernels themselves are held to ref
    exactly in test_kernels.py. The KV cache is f32 here, so that the f16 cache's rounding, a
    discrete step of the same kind, does not blur the W4A16 bound.
    """
    model = pull(str(tiny_models(family)), variant=variant, out=tmp_path / "m")
    sequences = [[int(t) for t in rng.integers(0, 384, size=24)] for _ in range(3)]
    batches = [Engine(model, precision=precision, ctx=64, kv_cache="f32").prefill(ids, all_logits=True)
               for ids in sequences]
    for backend in ("cpu", "ref"):
        errs = []
        for ids, batch in zip(sequences, batches):
            e = Engine(model, backend=backend, precision=precision, ctx=64, kv_cache="f32")
            e.prefill(ids[:1])
            errs += [rel_err(e.decode(t), batch[i]) for i, t in enumerate(ids[1:], start=1)]
        errs = np.array(errs)
        if precision == "w4a16":
            assert errs.max() < W4A16_RTOL, (backend, errs)
        else:
            assert errs.min() < 1e-5 and errs.max() < 1e-1, (backend, errs)


def test_q4_0_w4a8_differs_from_w4a16_but_little(tiny_models, tmp_path, rng):
    model = pull(str(tiny_models("llama")), variant="q4_0", out=tmp_path / "m")
    ids = [int(t) for t in rng.integers(0, 384, size=16)]
    a16 = Engine(model, precision="w4a16", ctx=64).prefill(ids, all_logits=True)
    a8 = Engine(model, precision="w4a8", ctx=64).prefill(ids, all_logits=True)
    err = rel_err(a8, a16)
    # int8 activations cost 2.5% to 10.5% of the logits' norm on this model (2000 seeds: median
    # 4.0%, 99th percentile 5.9%, one above 10%, which the old bound of 0.1 failed; its weights
    # are wide, std 0.25, so activation outliers are large): not zero, not O(1)
    assert 0.005 < err < 0.2


# plain, qkv bias, q/k norms; Gemma 3's GeGLU, post norms and windows (12 positions, 8 seen); Q4
# layers with f16 matrices among their Q4 ones (KEPT_EXACT)
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma2", "gemma3", "qwen3-hd48", "qwen3-h80"])
@pytest.mark.parametrize("variant", ["q4_0", "q4_1", "f16", "bf16"])
def test_compiled_layer_halves_equal_the_layer_kernel_by_kernel(family, variant, tiny_models, tmp_path, rng):
    """The cpu backend runs a resident Q4 or exact layer's decode step in a few compiled calls
    bound once (cpu.decode_layer_halves): the same kernels on the same buffers as _decode_layer's
    calls one by one, so the logits are equal to the bit, not merely close, at every precision
    and either KV cache type."""
    model = pull(str(tiny_models(family)), variant=variant, out=tmp_path / "m")
    ids = [int(t) for t in rng.integers(0, 384, size=12)]
    for precision in ("w4a8", "w4a16") if variant.startswith("q4") else (None,):
        for kv_cache in ("f16", "f32"):
            runs = []
            for compiled in (True, False):
                e = Engine(model, precision=precision, ctx=64, kv_cache=kv_cache)
                assert sorted(e.compiled_layers) == list(range(e.cfg.num_layers))
                if not compiled:
                    e.compiled_layers.clear()
                e.prefill(ids[:4])
                runs.append(np.array([e.decode(t).copy() for t in ids[4:]]))
            np.testing.assert_array_equal(runs[0], runs[1], err_msg=f"{precision}, {kv_cache} cache")


def test_the_ref_backend_runs_layers_kernel_by_kernel(tiny_models, tmp_path):
    """Only the cpu backend has compiled halves; ref keeps the kernel-by-kernel layer."""
    for variant in ("f16", "q4_0"):
        model = pull(str(tiny_models("llama")), variant=variant, out=tmp_path / variant)
        assert Engine(model, ctx=64).compiled_layers
        assert Engine(model, backend="ref", ctx=64).compiled_layers == {}


@pytest.mark.parametrize("decodes", [True, False])
def test_compiled_before_reads_the_disk_cache_index(tiny_models, tmp_path, monkeypatch, decodes):
    """cpu.compiled_before(), behind the CLI's first-run note, is True once a decode (or, for a run
    that only prefills, a prefill) has put its kernels' code in the disk cache, and False when the
    cache's index was written for another version of the source (numba then compiles again)."""
    from nerva_cli.planes.cpu import kernels as cpu

    model = pull(str(tiny_models("llama")), variant="q4_0", out=tmp_path / "m")
    e = Engine(model, ctx=64)
    e.prefill([3, 4, 5])
    if decodes:
        e.decode(6)
    assert cpu.compiled_before(decodes)
    kernel = cpu.add_rmsnorm if decodes else cpu_prefill_attention._attention_prefill
    monkeypatch.setattr(kernel._cache._cache_file, "_source_stamp", ("another source", 0))
    assert not cpu.compiled_before(decodes)


@pytest.mark.parametrize("aside", [False, True])
def test_warm_up_leaves_no_trace_in_the_next_answer(tiny_models, tmp_path, rng, aside):
    """Engine.warm_up (a first run's compile, before the answer) forgets its token: the logits
    after it are a fresh engine's, bit for bit, and the phase clocks start from zero. With a
    child compiling aside, the parent's MLP halves compile without running on its buffers."""
    model = pull(str(tiny_models("llama")), variant="q4_0", out=tmp_path / "m")
    ids = [int(t) for t in rng.integers(3, 300, 9)]
    fresh = Engine(model, ctx=64)
    want = [fresh.prefill(ids).copy(), fresh.decode(ids[0]).copy()]
    warmed = Engine(model, ctx=64)
    warmed.warm_up(warmed.compile_aside() if aside else None)
    assert warmed.n_past == 0 and not any(warmed.phase_ns.values())
    got = [warmed.prefill(ids).copy(), warmed.decode(ids[0]).copy()]
    assert all(np.array_equal(a, b) for a, b in zip(got, want))


def test_decode_allocates_nothing_after_warmup(tiny_models, tmp_path):
    models = {v: pull(str(tiny_models("qwen3")), variant=v, out=tmp_path / v) for v in ("q4_0", "q4_1", "f16")}
    for variant, precision in (("q4_0", "w4a8"), ("q4_0", "w4a16"), ("q4_1", "w4a8"), ("q4_1", "w4a16"),
                               ("f16", None)):
        engine = Engine(models[variant], precision=precision, ctx=64)
        assert engine.count_hot_path_allocations([3, 4, 5], steps=12) == 0, variant
    gemma = pull(str(tiny_models("gemma3")), variant="q4_0", out=tmp_path / "gemma3")  # its windows' cache views
    assert Engine(gemma, ctx=64).count_hot_path_allocations([3, 4, 5], steps=12) == 0


def test_allocation_counter_sees_an_allocation_in_decode(tiny_models, tmp_path, monkeypatch):
    """The negative control: a decode that makes one intermediate-sized buffer of a real model
    (1536 floats: 6 KiB, SmolLM2's MLP width) is counted."""
    model = pull(str(tiny_models("qwen3")), variant="q4_0", out=tmp_path / "m")
    engine = Engine(model, ctx=64)
    real = Engine.decode
    monkeypatch.setattr(Engine, "decode", lambda self, t: real(self, t) + np.zeros(1536, np.float32)[:1])
    assert engine.count_hot_path_allocations([3, 4, 5], steps=12) == 12


@pytest.mark.parametrize("variant", ["q4_0", "q4_1"])
@pytest.mark.parametrize("precision", ["w4a16", "w4a8"])
def test_prefill_last_logits_come_from_the_lm_head_matvec(precision, variant, tiny_models, tmp_path, monkeypatch,
                                                          rng):
    """A prompt's last logits take decode's lm_head matvec, so its Q8_0 table is not dequantised
    for one row (the GEMM's way cost SmolLM2 12 ms a prompt on the 2-core Zen 4 EPYC), and they
    match the all-rows GEMM's last row. Same weights, and the same activation codes for W4A8
    (one rmsnorm, one quantiser); W4A16's matvec rounds the activation to int16 codes per
    32-group (2^-16 of its largest value), the GEMM keeps f32, and their sums run in different
    orders. Over 100 seeds a variant: W4A16 at most 3.1e-5 relative (median 2.1e-5), W4A8 1.8e-7;
    so 1e-4 (a wrong norm or table gives O(1))."""
    model = pull(str(tiny_models("llama-untied")), variant=variant, out=tmp_path / "m")
    ids = [int(t) for t in rng.integers(0, 384, size=int(rng.integers(1, 24)))]
    every = Engine(model, precision=precision, ctx=64).prefill(ids, all_logits=True)
    engine = Engine(model, precision=precision, ctx=64)
    assert engine.lm_head.q8 is not None

    def no_table(*args):
        raise AssertionError("the lm_head table was dequantised for the last row")
    monkeypatch.setattr(engine.k, "dequantize_q8", no_table)
    assert rel_err(engine.prefill(ids), every[-1]) < 1e-4


@pytest.mark.parametrize("variant", ["q4_0", "q4_1"])
@pytest.mark.parametrize("precision", ["w4a16", "w4a8"])
def test_short_prompts_take_the_batch_kernels(precision, variant, tiny_models, tmp_path, monkeypatch, rng):
    """A chunk of at most the backend's short_prefill_rows tokens runs the matvecs' batch
    kernels, not dequantise + GEMM. On the same input, each matrix's output agrees with the
    GEMM's: the same products
    (for W4A8 the same codes, from one quantiser) summed in another order: over 100 seeds a
    case, four matrices each, at most 2.6e-7 relative (median 1.0e-7 to 1.8e-7), so 1e-5; plus,
    where W4A16 runs in bf16 dots (AVX512-BF16), its activations' split error, at most 2^-16 of
    each product's magnitude (test_kernels' SPLIT_ERROR): Q4_1 at W4A16 there measured a median
    of 5.7e-6 and at most 9.4e-6 over 60 seeds, three matrices each, and 1.02e-5 in a CI run;
    where W4A16 takes Q16 codes (no AVX-512F), their rounding, at most half a group's step. (A
    whole W4A8 prompt is no test: an input within f32 noise of a code boundary lands on the
    other code in one path, which moved the logits by up to 1.5e-2 in 16-26% of 150 prompts a
    variant; see test_q4_decode_matches_prefill_and_ref. At W4A16 the prompts' logits differed
    by at most 1.8e-6.)"""
    from nerva_cli.planes.cpu import kernels as cpu

    model = pull(str(tiny_models("llama-untied")), variant=variant, out=tmp_path / "m")
    engine = Engine(model, precision=precision, ctx=80, kv_cache="f32")
    most = min(cpu.short_prefill_rows(precision), engine.pw.rows)  # W4A8 on AVX2 or AVX-512BW: any chunk
    assert most > 0
    T = int(rng.integers(2, max(most, 16) + 1))
    layer = next(iter(engine.weights.layers()))
    mats = [[layer.mats["qkv"]], [layer.mats["o"]], [layer.mats["gate_up"]], [layer.mats["down"]],
            [layer.mats["gate_up"], layer.mats["qkv"]]]  # stacked, as a paged layer's q, k, v are
    xs = [rng.standard_normal((T, m[0].cols)).astype(np.float32) for m in mats]
    def no_gemm(*args):
        raise AssertionError("a short prompt's weights were dequantised for a GEMM")
    monkeypatch.setattr(engine.k, "dequantize_q4", no_gemm)
    short = [np.empty((T, sum(lin.rows for lin in m)), np.float32) for m in mats]
    for m, x, out in zip(mats, xs, short):
        engine._dense(m, x, precision, out)
    engine.prefill([int(t) for t in rng.integers(0, 384, size=T)])  # every layer, the lm_head too
    monkeypatch.undo()
    monkeypatch.setattr(engine.k, "short_prefill_rows", lambda precision: 0)
    split = precision == "w4a16" and cpu_target._AVX512BF16
    q16 = precision == "w4a16" and not cpu_target._AVX512F
    for m, x, got in zip(mats, xs, short):
        want = np.empty_like(got)
        engine._dense(m, x, precision, want)
        bound = 1e-5
        if split:  # Q4_1 sums d q x and m x apart: their magnitudes (as test_kernels' bound)
            w = np.concatenate([dequantize_q4(lin.qs, lin.d, lin.m) for lin in m]).astype(np.float64)
            offset = np.concatenate([np.repeat(lin.m.astype(np.float64), 32, axis=1) if lin.m is not None
                                     else np.zeros((lin.rows, lin.cols)) for lin in m])
            magnitude = np.abs(x) @ (np.abs(w - offset) + np.abs(offset)).T
            bound += SPLIT_ERROR * np.linalg.norm(magnitude) / np.linalg.norm(want)
        if q16:  # each activation within half its group's Q16 step of the GEMM's f32 one
            w = np.concatenate([dequantize_q4(lin.qs, lin.d, lin.m) for lin in m]).astype(np.float64)
            steps = np.abs(x).reshape(x.shape[0], -1, 32).max(2) / 32767 * (0.5 + 1e-3)
            bound += np.linalg.norm(np.repeat(steps, 32, axis=1) @ np.abs(w).T) / np.linalg.norm(want)
        assert rel_err(got, want) < bound


def test_exact_matrices_back_to_back_in_the_file_are_fused_without_a_copy(rng):
    """Linear.owned views q, k, v (or gate, up) in the file's buffer where nothing lies between
    them, and copies them together where alignment padding does."""
    from nerva_cli.planes.cpu.engine import Linear, back_to_back
    from nerva_cli.store.catalog import tensors_in

    q, k = rng.standard_normal((8, 64)).astype(np.float16), rng.standard_normal((4, 64)).astype(np.float16)
    for gap in (0, 4096):
        buf = np.zeros(q.nbytes + gap + k.nbytes, np.uint8)
        buf[:q.nbytes] = q.view(np.uint8).ravel()
        buf[q.nbytes + gap:] = k.view(np.uint8).ravel()
        t = tensors_in(buf, {"q": {"dtype": "f16", "offset": 0, "nbytes": q.nbytes, "shape": [8, 64]},
                             "k": {"dtype": "f16", "offset": q.nbytes + gap, "nbytes": k.nbytes, "shape": [4, 64]}})
        lin = Linear.owned(t, ("q", "k"))
        assert (lin.rows, lin.cols) == (12, 64)
        np.testing.assert_array_equal(lin.w.view(np.uint16), np.concatenate([q, k]).view(np.uint16))
        assert np.shares_memory(lin.w, buf) == (gap == 0)
        assert (back_to_back([t["q"], t["k"]]) is None) == (gap > 0)
        assert back_to_back([t["k"], t["q"]]) is None  # out of order


@pytest.mark.parametrize("variant,dtype", [("f16", np.float16), ("bf16", np.uint16)])
def test_exact_variants_hold_their_weights_as_stored(variant, dtype, tiny_models, tmp_path):
    """No widening at load: an exact model's matrices and token table keep the file's 2-byte
    elements (f32 copies doubled SmolLM2 f16's 269 MB of weights to 513), and what the engine
    holds of a layer's matrices is what its file holds."""
    from nerva_cli.model.layout import MATRICES, layer_file

    model = pull(str(tiny_models("llama")), variant=variant, out=tmp_path / "m")
    e = Engine(model, ctx=64)
    assert e.embed.w.dtype == dtype
    for layer in e.weights.layers():
        stored = model.read_file(layer_file(layer.index))
        assert all(lin.w.dtype == dtype for lin in layer.mats.values())
        assert sum(lin.nbytes for lin in layer.mats.values()) == sum(stored[n].nbytes for n in MATRICES)
