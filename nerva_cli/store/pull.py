"""pull/convert: resolve a source, convert it into the store (or a directory), return the model."""

from __future__ import annotations

from pathlib import Path

from nerva_cli.store.convert import Progress, conversion_notes, convert, default_variant
from nerva_cli.errors import BadInput, UsageError
from nerva_cli.store.catalog import VARIANTS, StoredModel, load_metadata, models_root, parse_ref


def pull(spec: str, variant: str = "auto", name: str | None = None, out: Path | None = None,
         force: bool = False, revision: str | None = None, progress: Progress | None = None,
         notes: list[str] | None = None, keep_existing: bool = False, say=None) -> StoredModel:
    """The source converted into the store (or `out`). `keep_existing` (nerva pull's way, as
    ollama's pull: a script may pull before every run): a model already there is kept and
    returned, not refused, when its files have the sizes metadata.json gives; --force converts it
    again either way. A store write holds the name's lock (store/locks.py): `say` gets the line
    saying whom it waits for."""
    from nerva_cli.store import locks
    from nerva_cli.store.sources.resolve import open_source

    if variant != "auto" and variant not in VARIANTS:  # before a download, not after
        raise UsageError(f"--quant {variant}: choose auto, {', '.join(VARIANTS)}")
    source = open_source(spec, revision=revision)
    try:
        if variant == "auto":
            variant = default_variant(source)
        notes = [] if notes is None else notes
        repair = _again(spec, name, variant, revision, out)
        if out is not None:
            return _write(source, variant, Path(out).expanduser(), force, progress, notes, keep_existing, repair)
        model_name, _ = parse_ref(name or source.default_name)
        with locks.writing(model_name, say):
            locks.sweep()  # what writers killed before left, this name's too (its lock is ours now)
            return _write(source, variant, models_root() / model_name / variant, force, progress, notes,
                          keep_existing, repair)
    finally:
        source.close()


def _write(source, variant: str, target: Path, force: bool, progress, notes: list[str], keep_existing: bool,
           repair: str) -> StoredModel:
    from nerva_cli.store.locks import exclusive

    if keep_existing and not force and target.exists():
        model = _intact(target, repair)
        notes.append(f"{target} is already in the store: kept (--force converts it again)")
        return model
    if force and target.is_dir() and not target.is_symlink():
        with exclusive(target):  # a run reading it refuses the swap: say so now, not after converting
            pass
    notes.extend(conversion_notes(source, variant))
    convert(source, variant, target, force=force, progress=progress)
    return load_metadata(target)


def _intact(target: Path, repair: str) -> StoredModel:
    """The model at `target`, or an error naming what is damaged and the repair: metadata.json
    unreadable, files missing or of other sizes than it gives (a stat each: no hashing)."""
    try:
        model = load_metadata(target)
    except BadInput as e:
        raise BadInput(f"{e}; `{repair}` converts it again") from None
    damage = model.size_damage()
    if damage:
        more = f" and {len(damage) - 3} more" if len(damage) > 3 else ""
        raise BadInput(f"{target} is damaged ({'; '.join(damage[:3])}{more}); `{repair}` converts it again")
    return model


def _again(spec: str, name: str | None, variant: str, revision: str | None, out: Path | None) -> str:
    """This pull (or convert --out) again, with --force: the repair a damaged target names."""
    from shlex import quote

    if out is not None:
        return f"nerva convert {quote(spec)} --quant {variant} --out {quote(str(out))} --force"
    return (f"nerva pull {quote(spec)}{f' --name {quote(name)}' if name else ''}"
            f"{f' --revision {quote(revision)}' if revision else ''} --quant {variant} --force")


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
