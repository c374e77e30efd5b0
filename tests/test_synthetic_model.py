"""scripts/synthetic_model.py's GGUF output, which the CPU comparison with llama.cpp at bigger sizes
reads (scripts/compare_llamacpp.py --gguf): gguf-py, not nerva, decodes what it wrote."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import load_script

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def synthetic():
    return load_script("synthetic_model")


def weights_from_planes(qs, d, m):
    """ARCHITECTURE section 6 in NumPy: byte j of a Q4 block holds element j (low nibble) and
    j + 16 (high); w = d (q - 8), d q + m (Q4_1) or d q (Q8_0, int8 codes), in float32."""
    rows, blocks = d.shape
    scale = d.astype(np.float32)[:, :, None]
    if qs.dtype == np.int8:
        return (scale * qs.reshape(rows, blocks, 32).astype(np.float32)).reshape(rows, -1)
    codes = qs.reshape(rows, blocks, 16)
    q = np.concatenate([codes & 15, codes >> 4], axis=2).astype(np.float32)
    w = scale * q + m.astype(np.float32)[:, :, None] if m is not None else scale * (q - 8)
    return w.reshape(rows, -1)


@pytest.mark.parametrize("kind", ["q4_0", "q4_1", "q8_0"])
def test_gguf_blocks_hold_the_planes_weights(kind, synthetic, rng):
    rows, cols = 7, 160
    qs = (rng.integers(-127, 128, (rows, cols), dtype=np.int8) if kind == "q8_0"
          else rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8))
    d = rng.uniform(0.01, 0.1, (rows, cols // 32)).astype(np.float16)
    m = (-8 * d.astype(np.float32) * rng.uniform(0.9, 1.1, d.shape)).astype(np.float16) if kind == "q4_1" else None
    raw = synthetic.gguf_blocks(qs, d, m)
    got = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, kind.upper()))
    # both take d q (+ m) in float32 from the same f16 scales; 1e-6 leaves room for an FMA
    np.testing.assert_allclose(got, weights_from_planes(qs, d, m), rtol=1e-6, atol=1e-7)


def test_a_written_gguf_converts_with_its_shape_and_weights(synthetic, tmp_path, monkeypatch):
    from nerva_cli.store.pull import pull

    from conftest import smollm2_gguf

    smollm2_gguf()  # the tokenizer comes from the bundled GGUF: skips without it
    # hidden, intermediate, layers, heads, kv heads, head dim, vocab (SmolLM2's), rope theta, tied
    monkeypatch.setitem(synthetic.SHAPES, "tiny", (64, 96, 2, 4, 2, 16, 49152, 10000.0, True))
    path = tmp_path / "tiny.gguf"
    synthetic.write_gguf("tiny", path, "q4_1")
    assert not list(tmp_path.glob("*.tmp"))
    model = pull(str(path), variant="auto", out=tmp_path / "store")
    cfg = model.config
    assert (model.variant, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads,
            cfg.num_kv_heads, cfg.vocab_size) == ("q4_1", 64, 96, 2, 4, 2, 49152)
    reader = gguf.GGUFReader(str(path))
    tensor = next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight")
    want = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    down = model.read_file("layer_001.bin")
    assert down["down.qs"].shape == (64, 48)
    np.testing.assert_allclose(weights_from_planes(down["down.qs"], down["down.d"].view(np.float16),
                                                   down["down.m"].view(np.float16)), want, rtol=1e-6, atol=1e-7)


def test_an_f16_gguf_holds_f16_matrices_and_pulls_exact(synthetic, tmp_path, monkeypatch):
    """--quant f16: every matrix F16 and the norms F32, as llama.cpp's F16 files; pulled as the f16
    variant, nerva's layer file holds the very f16 values gguf-py reads back."""
    from nerva_cli.store.pull import pull

    from conftest import smollm2_gguf

    smollm2_gguf()
    monkeypatch.setitem(synthetic.SHAPES, "tiny", (64, 96, 2, 4, 2, 16, 49152, 10000.0, True))
    path = tmp_path / "tiny.gguf"
    synthetic.write_gguf("tiny", path, "f16")
    reader = gguf.GGUFReader(str(path))
    kinds = {t.name: t.tensor_type for t in reader.tensors}
    assert all(k == gguf.GGMLQuantizationType.F16 for n, k in kinds.items() if not n.endswith("norm.weight"))
    assert all(k == gguf.GGMLQuantizationType.F32 for n, k in kinds.items() if n.endswith("norm.weight"))
    model = pull(str(path), variant="f16", out=tmp_path / "store")
    want = next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight").data
    got = model.read_file("layer_001.bin")["down"]
    assert got.dtype == np.float16 and float(np.abs(got.astype(np.float32)).max()) > 0
    np.testing.assert_array_equal(got.view(np.uint16), np.asarray(want).reshape(got.shape).view(np.uint16))


def test_a_qwen2_shape_keeps_its_biases_and_own_output_and_checks_the_vocab(synthetic, tmp_path, monkeypatch):
    # --vocab's path: the tokenizer of a given GGUF (here the bundled one, named explicitly), q/k/v
    # biases as attn_*.bias and an untied output.weight, which `pull` reads back as Qwen2's; a
    # vocabulary of another size than the shape's is refused before anything is written.
    from nerva_cli.store.pull import pull

    from conftest import smollm2_gguf

    vocab = smollm2_gguf()
    monkeypatch.setitem(synthetic.SHAPES, "qwen2-tiny", (64, 96, 2, 4, 2, 16, 49152, 1e6, False))
    path = tmp_path / "qwen2-tiny.gguf"
    synthetic.write_gguf("qwen2-tiny", path, "q4_0", vocab)
    names = {t.name for t in gguf.GGUFReader(str(path)).tensors}
    assert {"blk.1.attn_q.bias", "blk.1.attn_v.bias", "output.weight"} <= names
    cfg = pull(str(path), variant="auto", out=tmp_path / "store").config
    assert (cfg.family, cfg.qkv_bias, cfg.tie_embeddings) == ("qwen2", True, False)
    monkeypatch.setitem(synthetic.SHAPES, "qwen2-tiny", (64, 96, 2, 4, 2, 16, 1000, 1e6, False))
    with pytest.raises(SystemExit, match="has 49152 tokens, the shape 1000"):
        synthetic.write_gguf("qwen2-tiny", tmp_path / "other.gguf", "q4_0", vocab)
    assert not (tmp_path / "other.gguf").exists()
