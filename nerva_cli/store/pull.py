"""pull/convert: resolve a source, convert it into the store (or a directory), return the model."""

from __future__ import annotations

from pathlib import Path

from nerva_cli.store.convert import Progress, conversion_notes, convert, default_variant
from nerva_cli.errors import BadInput
from nerva_cli.store.catalog import VARIANTS, StoredModel, load_metadata, models_root, parse_ref


def pull(spec: str, variant: str = "auto", name: str | None = None, out: Path | None = None,
         force: bool = False, revision: str | None = None, progress: Progress | None = None,
         notes: list[str] | None = None, keep_existing: bool = False) -> StoredModel:
    """The source converted into the store (or `out`). `keep_existing` (nerva pull's way, as
    ollama's pull: a script may pull before every run): a model already there is kept and
    returned, not refused; --force converts it again either way."""
    from nerva_cli.store.sources.resolve import open_source

    if variant != "auto" and variant not in VARIANTS:  # before a download, not after
        raise BadInput(f"--quant {variant}: choose auto, {', '.join(VARIANTS)}")
    source = open_source(spec, revision=revision)
    try:
        if variant == "auto":
            variant = default_variant(source)
        if out is not None:
            target = Path(out).expanduser()
        else:
            model_name, _ = parse_ref(name or source.default_name)
            target = models_root() / model_name / variant
        if keep_existing and not force and target.exists():
            if notes is not None:
                notes.append(f"{target} is already in the store: kept (--force converts it again)")
            return load_metadata(target)
        if notes is not None:
            notes.extend(conversion_notes(source, variant))
        convert(source, variant, target, force=force, progress=progress)
    finally:
        source.close()
    return load_metadata(target)


def source_changed(model: StoredModel, spec: str) -> bool:
    """Whether the source `model` was converted from (a local path) now differs from what it was
    then, by the fingerprint the conversion recorded (a GGUF's name, size and first MB, read
    without parsing the file; a safetensors directory's file names, sizes and tensor table)."""
    from nerva_cli.store.sources.gguf_file import fingerprint
    from nerva_cli.store.sources.resolve import open_source

    path = Path(spec).expanduser()
    if path.suffix.lower() == ".gguf":
        now = fingerprint(path)
    else:
        source = open_source(spec)
        now = source.fingerprint
        source.close()
    return now != model.meta.get("source", {}).get("fingerprint")
