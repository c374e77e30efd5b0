"""sources.gguf_header against gguf-py's GGUFReader, on the bundled SmolLM2 GGUF and on GGUFs
that gguf-py's GGUFWriter writes with fresh random metadata of every value type. Values are
compared exactly: both sides decode the same bytes, so any difference is a parsing error."""

from __future__ import annotations

import numpy as np
import pytest

from nerva_cli.errors import BadInput
from nerva_cli.store.sources.gguf_header import read_header


def gguf_py_view(path):
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    fields = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    tensors = [(t.name, tuple(int(d) for d in t.shape), t.tensor_type, int(t.data_offset), int(t.n_bytes))
               for t in r.tensors]
    return fields, tensors, int(r.data_offset)


def our_view(path):
    h = read_header(path)
    return h.fields, [(t.name, t.dims, t.type, t.data_offset, t.n_bytes) for t in h.tensors], h.data_offset


def test_bundled_smollm2_header_equals_gguf_py():
    from conftest import smollm2_gguf

    path = smollm2_gguf()
    ours = our_view(path)
    assert ours == gguf_py_view(path)
    assert len(ours[0]["tokenizer.ggml.tokens"]) == 49152 and ours[0]["general.architecture"] == "llama"


def random_text(rng, longest: int) -> str:
    alphabet = list("abcXYZ 09_\n\t.") + ["é", "東", "😀", "\u2581", "Ġ"]
    return "".join(rng.choice(alphabet, size=int(rng.integers(0, longest + 1))))


def random_gguf(path, rng, alignment: int | None = None):
    """A GGUF with one key and one array of each value type, and tensors of four GGML types."""
    import gguf
    from gguf import GGMLQuantizationType as Q, GGUFValueType as T

    w = gguf.GGUFWriter(str(path), "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    for vtype, dtype in [(T.UINT8, np.uint8), (T.INT8, np.int8), (T.UINT16, np.uint16), (T.INT16, np.int16),
                         (T.UINT32, np.uint32), (T.INT32, np.int32), (T.UINT64, np.uint64), (T.INT64, np.int64)]:
        info = np.iinfo(dtype)
        draw = lambda n: rng.integers(info.min, info.max, size=n, endpoint=True, dtype=dtype).tolist()  # noqa: E731
        w.add_key_value(f"test.{vtype.name.lower()}", draw(1)[0], vtype)
        w.add_key_value(f"test.{vtype.name.lower()}s", draw(int(rng.integers(1, 40))), T.ARRAY, sub_type=vtype)
    # float32 values that a float32 holds exactly, so the written and the read value are one number
    w.add_key_value("test.float32", float(np.float32(rng.standard_normal())), T.FLOAT32)
    w.add_key_value("test.float32s", rng.standard_normal(17).astype(np.float32).tolist(), T.ARRAY, sub_type=T.FLOAT32)
    w.add_key_value("test.float64", float(rng.standard_normal() * 1e30), T.FLOAT64)
    w.add_key_value("test.float64s", rng.standard_normal(9).tolist(), T.ARRAY, sub_type=T.FLOAT64)
    w.add_key_value("test.bool", bool(rng.integers(2)), T.BOOL)
    w.add_key_value("test.bools", [bool(b) for b in rng.integers(0, 2, size=11)], T.ARRAY, sub_type=T.BOOL)
    w.add_key_value("test.string", random_text(rng, 30), T.STRING)
    w.add_key_value("test.strings", [random_text(rng, 12) for _ in range(int(rng.integers(1, 500)))] + ["café 😀"],
                    T.ARRAY, sub_type=T.STRING)

    rows = int(rng.integers(1, 5)) * 2
    w.add_tensor("token_embd.weight", rng.standard_normal((rows, 64)).astype(np.float32))
    w.add_tensor("output_norm.weight", rng.standard_normal(64).astype(np.float16))
    for name, qtype in [("blk.0.attn_q.weight", Q.Q8_0), ("blk.0.attn_k.weight", Q.Q4_0)]:
        w.add_tensor(name, gguf.quants.quantize(rng.standard_normal((rows, 64)).astype(np.float32), qtype),
                     raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64, 4096])
def test_random_header_equals_gguf_py(tmp_path, alignment):
    rng = np.random.default_rng()
    path = random_gguf(tmp_path / "r.gguf", rng, alignment)
    ours = our_view(path)
    assert ours == gguf_py_view(path)
    assert ours[2] % (alignment or 32) == 0
    assert [t[2].name for t in ours[1]] == ["F32", "F16", "Q8_0", "Q4_0"]


def test_nested_arrays_keep_their_nesting(tmp_path):
    """gguf-py flattens an array of arrays; nerva keeps the nesting (no model nerva runs has one,
    but a file with one must still be read)."""
    import gguf
    from gguf import GGUFValueType as T

    rng = np.random.default_rng()
    nested = [rng.integers(-99, 99, size=int(rng.integers(1, 6))).tolist() for _ in range(4)]
    w = gguf.GGUFWriter(str(tmp_path / "n.gguf"), "llama")
    w.add_key_value("test.nested", nested, T.ARRAY)
    w.add_tensor("token_embd.weight", rng.standard_normal((2, 32)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours = read_header(tmp_path / "n.gguf").fields["test.nested"]
    assert ours == nested
    assert sum(ours, []) == gguf_py_view(tmp_path / "n.gguf")[0]["test.nested"]


def test_a_header_cut_anywhere_is_refused_naming_the_file(tmp_path):
    rng = np.random.default_rng()
    full = random_gguf(tmp_path / "full.gguf", rng).read_bytes()
    data_offset = read_header(tmp_path / "full.gguf").data_offset
    cut = tmp_path / "cut.gguf"
    # everything before data_offset - 32 is header (the table ends within the last 32-byte pad);
    # one cut falls inside a 4-byte character of a string array, where a short read is bad UTF-8
    inside_a_character = full.index("😀".encode()) + 2
    ends = [4, 10, 23, inside_a_character, *np.linspace(24, data_offset - 33, 150).astype(int),
            *rng.integers(24, data_offset - 32, size=50)]
    for end in ends:
        cut.write_bytes(full[:int(end)])
        with pytest.raises(BadInput, match=r"cut\.gguf: cut short in its GGUF header"):
            read_header(cut)


@pytest.mark.parametrize("version, message", [(b"\x01\x00\x00\x00", "GGUF version 1 is not supported"),
                                              (b"\x00\x00\x00\x03", "a big-endian GGUF")])
def test_unreadable_versions_are_refused(tmp_path, version, message):
    full = random_gguf(tmp_path / "full.gguf", np.random.default_rng()).read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(full[:4] + version + full[8:])
    with pytest.raises(BadInput, match=rf"bad\.gguf: {message}"):
        read_header(bad)
