"""The command line: parses, calls one plain function per command, prints. Nothing else."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from nerva_cli.errors import NervaError

app = typer.Typer(
    name="nerva", add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
    help="Run LLMs where they don't fit: nerva schedules every block of weights and KV cache "
         "across memory tiers and shows where the time and the bytes went.",
    context_settings={"help_option_names": ["-h", "--help"]},
)

Quant = Annotated[str, typer.Option("--quant", "-q", help="Variant to write: q4_0, f16 or bf16.")]
Force = Annotated[bool, typer.Option("--force", help="Replace an existing model of the same name and variant.")]
Json = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]


def _pull(spec: str, quant: str, name: Optional[str], out: Optional[Path], force: bool,
          revision: Optional[str] = None):
    from nerva_cli import output
    from nerva_cli.pull import pull

    notes: list[str] = []
    with output.step_progress("converting") as progress:
        model = pull(spec, variant=quant, name=name, out=out, force=force, revision=revision,
                     progress=progress, notes=notes)
    for n in notes:
        output.note(n)
    cfg = model.config
    output.out.print(f"{model.name}:{model.variant}  {cfg.family}, {cfg.num_layers} layers, "
                     f"{output.human_bytes(model.size)}  -> {model.path}")
    return model


@app.command(epilog="Examples: nerva pull smollm2-135m | nerva pull Qwen/Qwen3-0.6B --quant f16")
def pull(
    source: Annotated[str, typer.Argument(help="HF repo id, local HF directory, .gguf file, or alias (smollm2-135m).")],
    name: Annotated[Optional[str], typer.Option(help="Store name (default: from the source).")] = None,
    quant: Quant = "q4_0",
    revision: Annotated[Optional[str], typer.Option(help="HF branch, tag or commit.")] = None,
    force: Force = False,
):
    """Fetch a model (HF Hub, local directory or GGUF) and convert it into the store."""
    _pull(source, quant, name, None, force, revision)


@app.command(epilog="Example: nerva convert ./SmolLM2-135M-Instruct --quant f16 --out /tmp/smol-f16")
def convert(
    source: Annotated[str, typer.Argument(help="Local HF safetensors directory or .gguf file.")],
    quant: Quant = "q4_0",
    out: Annotated[Optional[Path], typer.Option(help="Write the model directory here instead of the store.")] = None,
    name: Annotated[Optional[str], typer.Option(help="Store name (default: from the source).")] = None,
    force: Force = False,
):
    """Convert local weights into 4 KB-aligned per-layer files plus metadata.json."""
    if not Path(source).expanduser().exists():
        raise NervaError(f"{source}: no such file or directory (use `nerva pull` for a repo id or alias)")
    _pull(source, quant, name, out, force)


@app.command("list")
def list_(json_: Json = False):
    """List the models in the store."""
    from nerva_cli import output, store

    models = store.list_models()
    rows = [{"name": m.name, "variant": m.variant, "size": m.size, "family": m.config.family,
             "modified": store.modified(m), "path": str(m.path)} for m in models]
    if json_:
        output.print_json(rows)
        return
    if not rows:
        output.err.print(f"no models in {store.models_root()} (try: nerva pull smollm2-135m)")
        return
    from rich.table import Table

    table = Table(box=None, header_style="bold")
    for col in ("NAME", "SIZE", "FAMILY", "MODIFIED"):
        table.add_column(col)
    for r in rows:
        table.add_row(f"{r['name']}:{r['variant']}", output.human_bytes(r["size"]), r["family"], r["modified"])
    output.out.print(table)


@app.command()
def show(
    model: Annotated[str, typer.Argument(help="name[:variant] in the store, or a model directory.")],
    json_: Json = False,
    verify: Annotated[bool, typer.Option("--verify", help="Re-hash every file against metadata.json.")] = False,
):
    """Show a model's config, files and tensors."""
    from nerva_cli import output, store

    m = store.find_model(model)
    bad = m.verify() if verify else None
    if json_:
        output.print_json({"path": str(m.path), **m.meta, **({"verify_failed": bad} if verify else {})})
    else:
        _print_show(m)
        if verify and not bad:
            output.out.print(f"verified: {len(m.meta['files'])} files match metadata.json")
    if bad:
        raise NervaError(f"{m.path}: {len(bad)} file(s) differ from metadata.json: {', '.join(bad)}")


def _print_show(m) -> None:
    from collections import Counter

    from rich.table import Table

    from nerva_cli import output

    cfg = m.config
    output.out.print(f"[bold]{m.name}:{m.variant}[/bold]  {m.path}")
    table = Table(box=None, show_header=False)
    for k, v in cfg.to_dict().items():
        table.add_row(k, str(v))
    table.add_row("arch_hash", m.meta["arch_hash"])
    table.add_row("source", f"{m.meta['source'].get('kind')}: {m.meta['source'].get('id')}")
    table.add_row("size", f"{output.human_bytes(m.size)} in {len(m.meta['files'])} files")
    output.out.print(table)
    dtypes = Counter(t["dtype"] for f in m.meta["files"].values() for t in f["tensors"].values())
    largest = max(m.meta["files"].items(), key=lambda kv: kv[1]["size"])
    output.out.print(f"tensors: {sum(dtypes.values())} ({', '.join(f'{n} {d}' for d, n in sorted(dtypes.items()))}); "
                     f"largest file {largest[0]} {output.human_bytes(largest[1]['size'])}")


@app.command()
def rm(models: Annotated[list[str], typer.Argument(help="name or name:variant; a bare name removes every variant.")]):
    """Remove models from the store."""
    from nerva_cli import output, store

    for ref in models:
        for removed in store.remove(ref):
            output.out.print(f"deleted {removed}")


def main() -> None:
    try:
        app()
    except NervaError as e:
        from nerva_cli import output

        output.err.print(f"error: {e}", markup=False, highlight=False)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
