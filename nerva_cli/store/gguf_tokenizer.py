"""A GGUF's tokenizer as the files a store model keeps: tokenizer.json (built with `tokenizers`),
tokenizer_config.json (special tokens, chat template) and generation_config.json.

Where transformers' GGUF loader and llama.cpp disagree, this follows llama.cpp, which tokenizes
the way the model's own tokenizer did:
- byte-level BPE ("gpt2") splits text by `tokenizer.ggml.pre` with llama.cpp's expressions, so
  `pre = smollm` splits digits apart (transformers uses GPT-2's split for it, which differs on
  whitespace before a digit: "if x:\\n    1");
- control and user-defined tokens keep their text and their id even when it is not spelled in the
  byte alphabet (transformers drops those, so DeepSeek's `<｜begin▁of▁sentence｜>` would be cut up);
- SentencePiece ("llama") prepends the space per `add_space_prefix` to every run of text between
  special tokens, as SentencePiece and llama.cpp do (transformers prepends once, ignoring the flag).
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from nerva_cli.errors import BadInput

UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4

# llama.cpp's split expressions per `pre` (llama-vocab.cpp), for the families nerva runs. Other
# names get GPT-2's split, as in transformers; llama.cpp agrees for "gpt-2", "mpt", "olmo", not
# for the "default" of files older than the `pre` key.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# GPT-4o's (o200k, Phi-4-mini's): case runs split ("CamelCase" -> "Camel", "Case"), the
# contraction a suffix of its word, digits by three; the expression of the model's tokenizer.json,
# which llama.cpp rewrites for its own regex engine
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Mistral's Tekken (Mistral Nemo, Small 3, Ministral): GPT-4o's without the contraction suffix,
# a digit at a time
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_PRE = {"llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "smaug-bpe"}
SPLITS = {**dict.fromkeys(LLAMA3_PRE, _LLAMA3), "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2, "gpt-4o": _GPT4O,
          "tekken": _TEKKEN}
# llama.cpp isolates every digit first, then applies GPT-2's split (SmolLM's tokenizer.json too).
# Where llama.cpp ends a generation (its vocabulary's end-of-generation set): at the ids a GGUF
# names for these kinds, or where it names none, the first token spelt as one of the kind's
# (the FIM ones too: a code model's repository and padding markers), and at every token spelt as
# one of END_OF_GENERATION (a GGUF may name <eos> alone where its turns end at <end_of_turn>).
END_KINDS = {
    "eos": (), "eom": ("<|eom_id|>",),
    "eot": ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
            "_<EOT>", "[EOT]", "<\uff5cend\u2581of\u2581sentence\uff5c>", "<end_of_utterance>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",)}
END_OF_GENERATION = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
                     "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>")


def end_of_generation_ids(fields: Mapping[str, Any], tokens: list[str]) -> list[int]:
    """The ids llama.cpp ends a generation at for a GGUF's vocabulary (END_KINDS), the eos first."""
    ids = []
    for kind, spellings in END_KINDS.items():
        named = fields.get(f"tokenizer.ggml.{kind}_token_id")
        found = int(named) if named is not None else next((i for i, t in enumerate(tokens) if t in spellings), None)
        if found is not None:
            ids.append(found)
    return list(dict.fromkeys(ids + [i for i, t in enumerate(tokens) if t in END_OF_GENERATION]))


DIGIT_SPLIT = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"}


def _byte_spelling() -> list[str]:
    """GPT-2's printable character for each byte value, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    spelled, extra = [], 0
    for b in range(256):
        spelled.append(chr(b) if b in printable else chr(256 + extra))
        extra += b not in printable
    return spelled


def _byte_level(tokens: list[str], types: list[int], merges: list[str], pre: str | None):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    spelling = _byte_spelling()
    alphabet = set(spelling)
    vocab = {}
    for i, (t, kind) in enumerate(zip(tokens, types)):
        if kind not in (CONTROL, USER_DEFINED) and not set(t) <= alphabet:
            # written as text rather than in the byte alphabet the merges use: spell its bytes
            t = "".join(spelling[b] for b in t.encode())
        vocab[t] = i
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    # llama.cpp (and Llama 3's tokenizer.json) take a whole piece that is a token as is
    tok = Tokenizer(models.BPE(vocab, pairs, ignore_merges=pre in LLAMA3_PRE))
    if pre in SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre in DIGIT_SPLIT:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges the best-scored token first; ties broken as transformers does
    (longer left piece, longer right piece, then vocabulary order)."""
    ids = {t: i for i, t in enumerate(tokens)}
    found = []
    for t, score in zip(tokens, scores):
        splits = sorted((ids[t[:k]], ids[t[k:]], k) for k in range(1, len(t)) if t[:k] in ids and t[k:] in ids)
        found += [(score, t[:k], t[k:]) for _, _, k in splits]
    found.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)  # stable
    return [(left, right) for _, left, right in found]


def _sentencepiece(tokens: list[str], scores: list[float], merges: list[str] | None,
                   add_space_prefix: bool, unk: str | None):
    from tokenizers import Tokenizer, decoders, models, normalizers

    pairs = [tuple(m.split(" ", 1)) for m in merges] if merges else _merges_from_scores(tokens, scores)
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, pairs, unk_token=unk,
                               fuse_unk=True, byte_fallback=True))
    # a normalizer, not Metaspace: it runs on each stretch of text between special tokens
    steps = [normalizers.Replace(" ", "\u2581")]
    if add_space_prefix:
        steps.insert(0, normalizers.Prepend("\u2581"))
    tok.normalizer = normalizers.Sequence(steps)
    dec = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(dec)
    return tok


def tokenizer_files_from_gguf(fields: Mapping[str, Any], path: str = "") -> dict[str, str]:
    """{"tokenizer.json", "tokenizer_config.json", "generation_config.json": text} for a GGUF's
    metadata (`gguf_header.read_header(path).fields`); `path` names the file in errors."""
    from tokenizers import AddedToken

    kind = fields.get("tokenizer.ggml.model")
    tokens = fields.get("tokenizer.ggml.tokens")
    if kind is None or not tokens:
        raise BadInput(f"{path}: no tokenizer in the GGUF (tokenizer.ggml.model or .tokens is missing)")
    if kind not in ("gpt2", "llama"):
        raise BadInput(f"{path}: tokenizer model '{kind}' is not supported (supported: gpt2, llama)")
    types = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = fields.get("tokenizer.ggml.merges")
    pre = fields.get("tokenizer.ggml.pre")

    def token_of(key):
        i = fields.get(f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    named = {name: token_of(f"{name}_token_id") for name in ("bos", "eos", "padding")}
    named["unknown"] = token_of("unknown_token_id") or next(
        (t for t, k in zip(tokens, types) if k == UNKNOWN), None)
    try:
        if kind == "gpt2":
            if not merges:
                raise BadInput(f"{path}: byte-level BPE tokenizer without tokenizer.ggml.merges")
            tok = _byte_level(tokens, types, merges, pre)
        else:
            scores = fields.get("tokenizer.ggml.scores")
            if not scores and not merges:
                raise BadInput(f"{path}: SentencePiece tokenizer without tokenizer.ggml.scores")
            tok = _sentencepiece(tokens, scores, merges, bool(fields.get("tokenizer.ggml.add_space_prefix", True)),
                                 named["unknown"])
    except Exception as e:  # tokenizers raises a bare Exception for a merge of unknown tokens
        if isinstance(e, BadInput):
            raise
        raise BadInput(f"{path}: its tokenizer does not build ({str(e).splitlines()[0]}): a damaged file?") from None

    # llama.cpp matches these whole in the text, by type (a pad id may point at a plain token);
    # the special ones are dropped by decode(skip_special_tokens). Each keeps its id: its text is
    # already in the model's vocabulary.
    special = {t for t, k in zip(tokens, types) if k in (CONTROL, UNKNOWN)}
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tokens if t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, types) if k == USER_DEFINED and t not in special])

    add_bos = fields.get("tokenizer.ggml.add_bos_token", kind == "llama" or pre in LLAMA3_PRE)
    config = {"tokenizer_class": "PreTrainedTokenizerFast",
              "bos_token": named["bos"], "eos_token": named["eos"],
              "unk_token": named["unknown"], "pad_token": named["padding"],
              "add_bos_token": bool(add_bos),
              "add_eos_token": bool(fields.get("tokenizer.ggml.add_eos_token", False)),
              "clean_up_tokenization_spaces": False,
              "model_max_length": fields.get(f"{fields.get('general.architecture')}.context_length"),
              "chat_template": fields.get("tokenizer.chat_template")}
    eos = end_of_generation_ids(fields, tokens)
    bos = fields.get("tokenizer.ggml.bos_token_id")
    generation = {"bos_token_id": None if bos is None else int(bos),
                  "eos_token_id": eos[0] if len(eos) == 1 else (eos or None)}
    return {"tokenizer.json": tok.to_str(),
            "tokenizer_config.json": json.dumps({k: v for k, v in config.items() if v is not None}, indent=1),
            "generation_config.json": json.dumps(generation, indent=1)}
