"""Source -> store variant, one file at a time, written under a temporary directory and renamed
into place at the end (ARCHITECTURE 5)."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from typing import Callable

import numpy as np

from nerva_cli import __version__
from nerva_cli.errors import BadInput
from nerva_cli.model.layout import global_files, layer_file, layer_shapes, quantised, stored_format
from nerva_cli.model.quant import Q4_KINDS, QK, TABLE_KIND, quantize_blocks
from nerva_cli.store.sources import Source, SourceTensor, row_order, scaled
from nerva_cli.store.catalog import ALIGN, FORMAT, VARIANTS, LayerFileWriter, temp_dir
from nerva_cli.store.locks import exclusive

ROWS_PER_CHUNK_ELEMS = 1 << 20  # quantise in slices of about 1M weights: bounded temporaries
EXACT_SOURCE_TYPES = ("f32", "f16", "bf16")

Progress = Callable[[str, int, int], None]  # (what, done, total)


def to_bf16(w: np.ndarray) -> np.ndarray:
    """f32 -> bf16 bits, round to nearest even (as torch's .to(torch.bfloat16))."""
    u = np.ascontiguousarray(w, dtype=np.float32).view(np.uint32)
    return ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)


def _row_slices(t: SourceTensor):
    """(r0, r1, rows r0..r1 as f32) of matrix t, about ROWS_PER_CHUNK_ELEMS weights at a time,
    read a slice at a time where the source can (else from one whole read)."""
    n, cols = t.shape
    whole = t.read_f32() if t.read_f32_rows is None else None
    step = max(1, ROWS_PER_CHUNK_ELEMS // cols)
    for r in range(0, n, step):
        r1 = min(n, r + step)
        yield r, r1, whole[r:r1] if whole is not None else t.read_f32_rows(r, r1)


def _planes(t: SourceTensor, kind: str) -> tuple:
    """(codes, d, m) of t in block format kind (Q4_0, Q4_1, Q8_0): the source's planes as they are
    when it holds that format, else quantised in slices of rows."""
    if t.read_planes is not None and t.stored_dtype == kind:
        return t.read_planes()
    n, cols = t.shape
    q8 = kind == TABLE_KIND
    qs = np.empty((n, cols if q8 else cols // 2), dtype=np.int8 if q8 else np.uint8)
    d = np.empty((n, cols // 32), dtype=np.float16)
    m = np.empty_like(d) if kind == "q4_1" else None
    for r0, r1, w in _row_slices(t):
        qs[r0:r1], d[r0:r1], m_rows = quantize_blocks(w, kind)
        if m is not None:
            m[r0:r1] = m_rows
    return qs, d, m


def _exact(t: SourceTensor, fmt: str) -> np.ndarray:
    """Matrix t as f16, or as bf16 bits, converted a slice of rows at a time."""
    out = np.empty(t.shape, dtype=np.float16 if fmt == "f16" else np.uint16)
    for r0, r1, w in _row_slices(t):
        out[r0:r1] = w.astype(np.float16) if fmt == "f16" else to_bf16(w)
    return out


def _write_tensor(writer: LayerFileWriter, name: str, t: SourceTensor, variant: str) -> None:
    """Tensor t in its format (layout.stored_format): block planes under name.qs/.q8, .d (.m), an
    exact matrix or an f32 norm or bias under its name; metadata.json's dtypes say which."""
    fmt = stored_format(name, t.shape[-1], variant)
    if fmt == TABLE_KIND:
        q8, d, _ = _planes(t, TABLE_KIND)
        writer.add(f"{name}.q8", q8, "i8")
        writer.add(f"{name}.d", d, "f16")
    elif fmt in Q4_KINDS:
        qs, d, m = _planes(t, fmt)
        writer.add(f"{name}.qs", qs, "u8")
        writer.add(f"{name}.d", d, "f16")
        if m is not None:
            writer.add(f"{name}.m", m, "f16")
    elif fmt in ("f16", "bf16"):
        writer.add(name, _exact(t, fmt), fmt)
    else:  # norms and biases stay f32 in every variant
        writer.add(name, t.read_f32(), "f32")


def _stored(source: Source, canon: str) -> SourceTensor:
    """A source tensor in the store's layout: Granite's multipliers folded in (_folded); where
    RoPE rotates part of each head, the rows of q and k (and of their biases and norms) in
    rope.partial_rotary_order."""
    from nerva_cli.model.rope import partial_rotary_order

    t, cfg = _folded(source, canon), source.config
    if cfg.rotary_dim is None or _short(canon) not in ("q", "k", "q_bias", "k_bias", "q_norm", "k_norm"):
        return t
    head = partial_rotary_order(cfg.head_dim, cfg.rotary_dim)
    heads = np.arange(t.shape[0] // cfg.head_dim)[:, None] * cfg.head_dim
    return row_order(t, (heads + head).ravel())


def _folded(source: Source, canon: str) -> SourceTensor:
    """Granite's multipliers as Llama weights: the token table times the embedding's; q (and its
    bias) times the attention's over Llama's 1/sqrt(head_dim); o and down, whose outputs join the
    residual, times the residual's; the final norm over the logits' divisor (and over the
    embedding's where the table is also the lm_head, as it then was multiplied too). Where a norm
    follows, the factor goes into the norm, which would cancel it: the attention's into the q norm
    (Gemma 3 27B's 1/sqrt(query_pre_attn_scalar)), the residual's into the post norms."""
    t, cfg = source.tensors(canon), source.config
    s = cfg.folded_scales
    if not s:
        return t
    q, residual = s["attention"] * cfg.head_dim ** 0.5, s["residual"]
    factors = {"embed": s["embedding"],
               "final_norm": 1 / (s["logits"] * (s["embedding"] if cfg.tie_embeddings else 1))}
    factors.update({"q_norm": q} if cfg.qk_norm else {"q": q, "q_bias": q})
    factors.update({"post_attn_norm": residual, "post_mlp_norm": residual} if cfg.post_norms else
                   {"o": residual, "down": residual})
    factor = factors.get(_short(canon), 1.0)
    return t if factor == 1.0 else scaled(t, factor)


def _plan(cfg) -> list[tuple[str, dict[str, tuple[int, ...]]]]:
    """(file, {canonical tensor name: shape}) of every file a conversion writes, in order."""
    return list(global_files(cfg).items()) + [
        (layer_file(i), {f"layers.{i}.{n}": s for n, s in layer_shapes(cfg, i).items()})
        for i in range(cfg.num_layers)]


def _short(canon: str) -> str:
    """A tensor's name in its file: 'q' for 'layers.3.q', 'experts.5.up' for 'layers.3.experts.5.up';
    a global one's as it is."""
    return canon.split(".", 2)[2] if canon.startswith("layers.") else canon


def conversion_notes(source: Source, variant: str) -> list[str]:
    """What the conversion loses, said once: every stored type of the source's matrices that is
    not exact and not what the variant keeps (a K-quant file holds several); and, in a Q4 variant,
    how many matrices stay F16 because their rows are not whole blocks (as llama.cpp's quantiser
    says how many tensors "required fallback quantization")."""
    lossy, matrices, kept, widths = set(), 0, 0, {}
    for _, shapes in _plan(source.config):
        for canon, shape in shapes.items():
            name = _short(canon)
            if quantised(name):
                matrices += 1
                kind = source.tensors(canon).stored_dtype
                keeps = stored_format(name, shape[-1], variant)
                if kind not in EXACT_SOURCE_TYPES and kind != keeps:
                    lossy.add(kind)
                if variant in Q4_KINDS and keeps == "f16":
                    kept, widths[name.rsplit(".", 1)[-1]] = kept + 1, shape[-1]
    notes = []
    kinds = "/".join(sorted(k.upper() for k in lossy))
    if lossy and variant in Q4_KINDS:
        notes.append(f"source tensors are {kinds}: dequantised and requantised to {variant.upper()} (the token "
                     f"table to {TABLE_KIND.upper()}), which is lossy")
    elif lossy:
        notes.append(f"source tensors are {kinds}: dequantised to {variant} (exact from here on, but the source "
                     "was already quantised)")
    if kept:
        rows = ", ".join(f"{n} {w}" for n, w in widths.items())
        notes.append(f"{kept} of {matrices} matrices stay F16: their rows ({rows} wide) are not a multiple of "
                     f"{QK}, which {variant.upper()} blocks need (llama.cpp's quantiser falls back to F16 there too)")
    return notes


# Layer formats `--quant auto` turns into Q4_0: exact ones, and Q8_0, which is near them; every
# other quantised format (K-quants, Q5_0/Q5_1, i-quants) becomes Q4_1, whose per-block offset
# keeps what their asymmetric blocks or their first rounding left off-centre. SmolLM2-135M as a
# Q4_K_M GGUF (llama.cpp's quantiser; Q5_0 where a 576-wide row has no room for Q4_K), gpl3.txt,
# 512-token windows: llama.cpp 26.29 on that file, nerva's Q4_0 of it 38.48, its Q4_1 25.84.
NEAR_EXACT_SOURCE_TYPES = (*EXACT_SOURCE_TYPES, "q8_0")


def default_variant(source: Source) -> str:
    """`--quant auto`: a GGUF whose layers are Q4_0 or Q4_1 keeps that format (bit for bit); one
    in another quantised format becomes Q4_1, anything else Q4_0."""
    kind = source.tensors("layers.0.q").stored_dtype
    return kind if kind in Q4_KINDS else "q4_0" if kind in NEAR_EXACT_SOURCE_TYPES else "q4_1"


def convert(source: Source, variant: str, target: Path, force: bool = False,
            progress: Progress | None = None) -> Path:
    if variant not in VARIANTS:
        raise BadInput(f"unknown variant '{variant}' (variants: {', '.join(VARIANTS)})")
    cfg = source.config
    if (target.exists() or target.is_symlink()) and not force:
        raise BadInput(f"{target}: already exists (use --force to replace it)")
    plan = _plan(cfg)
    for _, tensors in plan:  # every shape is checked before anything is written
        for canon, want in tensors.items():
            t = _stored(source, canon)
            if tuple(t.shape) != tuple(want):
                raise BadInput(f"{t.where or source.origin['id']}: tensor '{canon}' has shape "
                               f"{list(t.shape)}, the config says {list(want)}")
    tmp = temp_dir(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        files = {}
        for step, (fname, tensors) in enumerate(plan):
            if progress:
                progress(fname, step, len(plan))
            writer = LayerFileWriter(tmp / fname)
            for canon in tensors:
                _write_tensor(writer, _short(canon), _stored(source, canon), variant)
            files[fname] = writer.close()
        for fname, text in source.tokenizer_files.items():
            (tmp / fname).write_text(text)
        meta = {
            "format": FORMAT, "nerva_version": __version__, "name": target.parent.name,
            "variant": variant, "alignment": ALIGN, "config": cfg.to_dict(),
            "arch_hash": cfg.arch_hash(),
            "source": {**source.origin, "fingerprint": source.fingerprint},
            "weights_fingerprint": _weights_fingerprint(files), "files": files,
        }
        (tmp / "metadata.json").write_text(json.dumps(meta, indent=1))
        if progress:
            progress("done", len(plan), len(plan))
        if target.exists() or target.is_symlink():
            if not force:  # another process converted it meanwhile: keep its copy, which a run may be reading
                return target
            if not target.is_dir() or target.is_symlink():
                raise BadInput(f"{target}: not a model directory; nerva replaces only a model directory it wrote")
            with exclusive(target):  # refused while a run reads it
                shutil.rmtree(target)
                os.rename(tmp, target)
        else:
            os.rename(tmp, target)
        return target
    except OSError as e:  # where the target cannot be written: one line naming the place
        if e.errno == errno.ENOSPC:
            raise BadInput(f"{target}: no space left on the device") from None
        where = f" ({e.filename})" if e.filename and str(e.filename) != str(target) else ""
        raise BadInput(f"{target}: cannot write the model there: {e.strerror}{where}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            target.parent.rmdir()  # only succeeds when the convert left it empty
        except OSError:
            pass


def _weights_fingerprint(files: dict) -> str:
    import hashlib

    h = hashlib.sha256()
    for fname in sorted(files):
        h.update(f"{fname}:{files[fname]['sha256']}".encode())
    return h.hexdigest()[:32]
