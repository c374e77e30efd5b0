"""The tokenizer built from a GGUF, the chat template and streaming detokenisation."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import smollm2_gguf
from nerva_cli.errors import BadInput

MIXED = ("Hello world! It's 2024; the naïve café served crème brûlée & résumés.\n"
         "def add(a, b):\n    return a + b  # 12345.678 + 0.5\n\n\n"
         "東京は大きい。 Добрый день. مرحبا 😀👍🏽 👨‍👩‍👧‍👦   trailing   spaces\t\ttabs\r\n"
         "<|im_start|>user\nhi<|im_end|>")


@pytest.fixture(scope="module")
def smol_tokenizer_dir(tmp_path_factory):
    from gguf import GGUFReader

    from nerva_cli.gguf_tokenizer import tokenizer_files_from_gguf

    path = smollm2_gguf()
    out = tmp_path_factory.mktemp("tok")
    for name, text in tokenizer_files_from_gguf(GGUFReader(str(path)), str(path)).items():
        (out / name).write_text(text)
    return out


def test_gguf_tokenizer_matches_transformers_gguf_loader(smol_tokenizer_dir):
    transformers = pytest.importorskip("transformers")
    from nerva_cli.tokenizer import TextTokenizer

    path = smollm2_gguf()
    hf = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours = TextTokenizer(smol_tokenizer_dir)
    ids = ours.encode(MIXED, add_special=False)
    assert ids == hf(MIXED, add_special_tokens=False)["input_ids"]
    assert ours.tok.token_to_id("<|im_start|>") in ids  # special tokens stay whole
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert ours.eos_ids == {2} and not ours.add_bos


def test_gguf_tokenizer_matches_llama_cpp(smol_tokenizer_dir):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from nerva_cli.tokenizer import TextTokenizer

    llm = llama_cpp.Llama(model_path=str(smollm2_gguf()), vocab_only=True, verbose=False)
    want = llm.tokenize(MIXED.encode(), add_bos=False, special=True)
    assert TextTokenizer(smol_tokenizer_dir).encode(MIXED, add_special=False) == want


def test_chat_template_renders_like_transformers(smol_tokenizer_dir):
    transformers = pytest.importorskip("transformers")
    from nerva_cli.tokenizer import TextTokenizer

    path = smollm2_gguf()
    hf = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Name a colour."}]
    ours = TextTokenizer(smol_tokenizer_dir).render_chat(messages, add_generation_prompt=True)
    assert ours == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.endswith("<|im_start|>assistant\n")


def test_stream_decoder_never_splits_a_character(smol_tokenizer_dir):
    from nerva_cli.tokenizer import TextTokenizer

    tok = TextTokenizer(smol_tokenizer_dir)
    ids = tok.encode(MIXED, add_special=False)
    dec = tok.stream_decoder()
    pieces = [dec.push(i) for i in ids] + [dec.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids)
    assert sum(1 for p in pieces if p == "") > 0  # some tokens held back half a character


def test_unsupported_tokenizer_model_is_refused(tmp_path, cli):
    import gguf

    path = tmp_path / "bert.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("bert")
    w.add_token_list(["[PAD]", "a", "b"])
    w.add_tensor("token_embd.weight", np.ones((3, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    from gguf import GGUFReader

    from nerva_cli.gguf_tokenizer import tokenizer_files_from_gguf

    with pytest.raises(BadInput, match=r"bert\.gguf: tokenizer model 'bert' is not supported"):
        tokenizer_files_from_gguf(GGUFReader(str(path)), str(path))
    code, _, err = cli("convert", path)
    assert code == 1 and "tokenizer model 'bert'" in err


def test_spm_tokenizer_round_trips(tmp_path):
    """A SentencePiece-style ("llama") vocabulary: scores rank merges, bytes fall back."""
    import gguf
    from gguf import GGUFReader

    from nerva_cli.gguf_tokenizer import tokenizer_files_from_gguf
    from tokenizers import Tokenizer

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + \
        ["\u2581", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "llo", "\u2581he", "\u2581hello", "\u2581w", "or", "ld", "\u2581wor", "\u2581world"]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces) - 259)]
    types = [2, 3, 3] + [6] * 256 + [1] * (len(pieces) - 259)
    path = tmp_path / "spm.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(pieces)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_tensor("token_embd.weight", np.ones((len(pieces), 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    files = tokenizer_files_from_gguf(GGUFReader(str(path)), str(path))
    tok = Tokenizer.from_str(files["tokenizer.json"])
    enc = tok.encode("hello world ü")
    assert enc.tokens[:2] == ["\u2581hello", "\u2581world"]
    assert "<0xC3>" in enc.tokens  # ü is not in the vocabulary: its UTF-8 bytes
    assert tok.decode(enc.ids) == "hello world ü"
    assert json.loads(files["tokenizer_config.json"])["add_bos_token"] is True
