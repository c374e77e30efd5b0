"""A GGUF's tokenizer as the files a store model keeps: tokenizer.json (built with `tokenizers`),
tokenizer_config.json (special tokens, chat template) and generation_config.json.

Byte-level BPE ("gpt2") vocabularies are rebuilt with the pre-tokenizer their `pre` names, the
way llama.cpp splits text for them; SentencePiece-style ("llama") vocabularies get a BPE with
merges ranked by the token scores and byte fallback.
"""

from __future__ import annotations

import json

from nerva_cli.errors import BadInput

CONTROL, USER_DEFINED = 3, 4

# llama.cpp's split expressions per `tokenizer.ggml.pre` (llama-vocab.cpp), for the families
# nerva runs; other names get GPT-2's split, as transformers' GGUF loader does.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLITS = {"llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "smaug-bpe": _LLAMA3,
          "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2}
DIGIT_SPLIT = {"smollm"}  # each digit its own piece, then GPT-2's split (SmolLM's tokenizer.json)


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _byte_level_pre_tokenizer(pre: str | None):
    from tokenizers import Regex, pre_tokenizers

    if pre in SPLITS:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(SPLITS[pre]), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre in DIGIT_SPLIT:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _gpt2(tokens: list[str], merges: list[str], pre: str | None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    table = {b: c for b, c in zip(range(256), _bytes_to_unicode())}
    # A token outside the byte alphabet is a llama.cpp mislabel; spell its UTF-8 in the alphabet.
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t if set(t) <= alphabet else "".join(table[b] for b in t.encode()), i)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab, pairs, fuse_unk=False))
    tok.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    return tok, alphabet


def _bytes_to_unicode() -> list[str]:
    """GPT-2's printable spelling of the 256 byte values, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _spm(tokens: list[str], scores: list[float], add_space_prefix: bool):
    """SentencePiece BPE: merges ranked by the score of the token they make."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for t, score in zip(tokens, scores):
        for k in range(1, len(t)):
            left, right = t[:k], t[k:]
            if left in vocab and right in vocab:
                merges.append((score, vocab[left], vocab[right], left, right))
    merges.sort(key=lambda m: (-m[0], m[1], m[2]))
    tok = Tokenizer(models.BPE(vocab, [(m[3], m[4]) for m in merges], byte_fallback=True, fuse_unk=True,
                               unk_token=tokens[0] if tokens else None))
    steps = [normalizers.Replace(" ", "\u2581")]
    if add_space_prefix:
        steps.insert(0, normalizers.Prepend("\u2581"))
    tok.normalizer = normalizers.Sequence(steps)
    dec = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(dec)
    return tok


def tokenizer_files_from_gguf(reader, path: str = "") -> dict[str, str]:
    from tokenizers import AddedToken

    kind = _field(reader, "tokenizer.ggml.model")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise BadInput(f"{path}: no tokenizer in the GGUF (tokenizer.ggml.tokens is missing)")
    types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        merges = _field(reader, "tokenizer.ggml.merges")
        if not merges:
            raise BadInput(f"{path}: byte-level BPE tokenizer without tokenizer.ggml.merges")
        tok, alphabet = _gpt2(tokens, merges, _field(reader, "tokenizer.ggml.pre"))
    elif kind == "llama":
        scores = _field(reader, "tokenizer.ggml.scores")
        if not scores:
            raise BadInput(f"{path}: SentencePiece tokenizer without tokenizer.ggml.scores")
        tok, alphabet = _spm(tokens, scores, bool(_field(reader, "tokenizer.ggml.add_space_prefix", True))), None
    else:
        raise BadInput(f"{path}: tokenizer model '{kind}' is not supported (supported: gpt2, llama)")
    special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types)
               if ty == CONTROL and (alphabet is None or set(t) <= alphabet)]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED]
    tok.add_special_tokens(special)
    tok.add_tokens(user)

    def token_of(key):
        i = _field(reader, key)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    bos_id, eos_id = _field(reader, "tokenizer.ggml.bos_token_id"), _field(reader, "tokenizer.ggml.eos_token_id")
    config = {"bos_token": token_of("tokenizer.ggml.bos_token_id"),
              "eos_token": token_of("tokenizer.ggml.eos_token_id"),
              "unk_token": token_of("tokenizer.ggml.unknown_token_id"),
              "pad_token": token_of("tokenizer.ggml.padding_token_id"),
              "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", kind == "llama")),
              "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False))}
    template = _field(reader, "tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    generation = {"bos_token_id": None if bos_id is None else int(bos_id),
                  "eos_token_id": None if eos_id is None else int(eos_id)}
    return {"tokenizer.json": tok.to_str(),
            "tokenizer_config.json": json.dumps({k: v for k, v in config.items() if v is not None}, indent=1),
            "generation_config.json": json.dumps(generation, indent=1)}
