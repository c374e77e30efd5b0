"""The store's commands: pull, convert, list, show, rm."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from nerva_cli.cli.app import app
from nerva_cli.cli.options import Force, Json, Quant
from nerva_cli.errors import NervaError, UsageError, read_json


def _pull(spec: str, quant: str, name: Optional[str], out: Optional[Path], force: bool,
          revision: Optional[str] = None, keep_existing: bool = False):
    from nerva_cli.cli import output
    from nerva_cli.runtime.open_engine import model_line, pull_model

    model = pull_model(spec, quant, name, out, force, revision, output.CliReporter(), keep_existing)
    output.out.print(model_line(model), markup=False)
    return model


@app.command(short_help="Fetch a model (HF Hub, local directory or GGUF) and convert it into the store.",
             epilog="Examples: nerva pull smollm2-135m | nerva pull smollm2-135m:f16 | "
                    "nerva pull hf.co/bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M | "
                    "nerva pull Qwen/Qwen3-0.6B --quant f16")
def pull(
    source: Annotated[str, typer.Argument(help="HF repo id (safetensors, or a GGUF repo with its file's quantisation as a tag: hf.co/USER/REPO:Q4_K_M), local HF directory, .gguf file, or alias (smollm2-135m).")],
    name: Annotated[Optional[str], typer.Option(help="Store name (default: from the source).")] = None,
    quant: Quant = "auto",
    revision: Annotated[Optional[str], typer.Option(help="HF branch, tag or commit.")] = None,
    force: Force = False,
):
    """Fetch a model (HF Hub, local directory or GGUF) and convert it into the store; one already
    there is kept (--force converts it again). An alias takes its variant as ollama's tags:
    smollm2-135m:f16."""
    from nerva_cli.store.sources.resolve import alias_ref

    aliased = alias_ref(source)
    if aliased is not None:
        alias, tagged = aliased
        if tagged != "auto" and quant not in ("auto", tagged):
            raise UsageError(f"{source} and --quant {quant} name two variants: give one")
        source, quant = alias, quant if tagged == "auto" else tagged
    _pull(source, quant, name, None, force, revision, keep_existing=True)


@app.command(epilog="Example: nerva convert ./SmolLM2-135M-Instruct --quant f16 --out /tmp/smol-f16")
def convert(
    source: Annotated[str, typer.Argument(help="Local HF safetensors directory or .gguf file.")],
    quant: Quant = "auto",
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
    """List the models in the store, with broken entries and conversions under way."""
    from nerva_cli.cli import output
    from nerva_cli.store import catalog as store
    from nerva_cli.store.locks import sweep

    models, broken = store.inventory()
    # every row has a status: ok; broken (metadata.json unreadable, files missing or of the wrong
    # size: `error` says which); writing (a pull under way: its pid) or stale (a killed writer's
    # leftovers that could not be removed yet)
    rows = [{"name": m.name, "variant": m.variant, "size": m.size, "family": m.config.family,
             "modified": store.modified(m), "path": str(m.path), "status": "ok"} for m in models]
    rows += [{"name": b.name, "variant": b.variant, "size": None, "family": None,
              "modified": store.modified_at(b.path), "path": str(b.path), "status": "broken", "error": b.error}
             for b in broken]
    rows += [{**t, "family": None, "modified": store.modified_at(Path(t["path"]))} for t in sweep()]
    rows.sort(key=lambda r: (r["name"], r["variant"]))
    if json_:
        output.print_json(rows)
        return
    if not rows:
        output.info(f"no models in {store.models_root()} (try: nerva pull smollm2-135m)")
        return
    output.columns(("NAME", "SIZE", "FAMILY", "MODIFIED"),
                   [(f"{r['name']}:{r['variant']}", "-" if r["size"] is None else output.human_bytes(r["size"]),
                     r["family"] if r["status"] == "ok" else r["status"] + (f" (pid {r['pid']})" if "pid" in r else ""),
                     r["modified"]) for r in rows])
    for r in rows:
        if r["status"] == "broken":
            output.note(f"{r['name']}:{r['variant']} is broken: {r['error']}; `nerva rm {r['name']}:{r['variant']}` "
                        "removes it, a pull with --force converts it again")


@app.command(epilog="Examples: nerva show smollm2-135m | nerva show smollm2-135m -v | nerva show smollm2-135m --json | jq .config")
def show(
    model: Annotated[str, typer.Argument(help="name[:variant] in the store, or a model directory.")],
    json_: Annotated[bool, typer.Option("--json", help="Print the whole record for scripts: the summary, metadata.json's config, source and files.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Add the config's fields (those set), the tensors and the arch hash.")] = False,
    verify: Annotated[bool, typer.Option("--verify", help="Re-hash every file against metadata.json.")] = False,
):
    """A model as `ollama show` shows it: architecture, parameters, context and embedding length,
    quantisation, chat template and license; its layers' mixed precision where it has a profile."""
    from nerva_cli.cli import output
    from nerva_cli.store import catalog as store

    m = store.find_model(model)
    bad = m.verify() if verify else None
    summary = _summary(m)
    if json_:
        output.print_json({"path": str(m.path), **summary, **m.meta, **({"verify_failed": bad} if verify else {})})
    else:
        _print_show(m, summary, verbose)
        if verify and not bad:
            output.out.print(f"verified: {len(m.meta['files'])} files match metadata.json")
    if bad:
        raise NervaError(f"{m.path}: {len(bad)} file(s) differ from metadata.json: {', '.join(bad)}; "
                         f"`{m.repair_command()}` converts the model again")


def _summary(m) -> dict:
    """What `show` says of a model, as --json gives it beside metadata.json's fields."""
    from nerva_cli.model.layout import MATRICES, layer_file, parameter_count
    from nerva_cli.runtime import mcap

    cfg, q4 = m.config, m.variant in ("q4_0", "q4_1")
    # a Q4 variant keeps a matrix whose rows are not whole blocks in f16 (layout.stored_format);
    # a mixture's first layer holds its experts' (the first expert's stand for all)
    first = layer_file(cfg.moe_layers[0]) if cfg.moe_layers else layer_file(0)
    names = [n for n in (*MATRICES, *(f"experts.0.{p}" for p in ("gate", "up", "down")))
             if any(t == n or t.startswith(f"{n}.") for t in m.meta["files"][first]["tensors"])]
    kept = [n for n in names if m.matrix_format(first, n) != m.variant]
    template = (m.path / "tokenizer_config.json").exists() and \
        bool(read_json(m.path / "tokenizer_config.json").get("chat_template"))
    found = mcap.find_profile(m) if q4 else None  # mixed precision needs one: the first run makes it
    mixed = None if found is None else mcap.layer_precisions(found.profile, mcap.DEFAULT_TAU)
    return {"architecture": cfg.family, "parameters": parameter_count(cfg), "context_length": cfg.max_context,
            "embedding_length": cfg.hidden_size, "layers": cfg.num_layers,
            "quantization": {"layer_matrices": m.variant, **({"f16_matrices": kept} if kept else {}),
                             "token_table": m.matrix_format("embed.bin", "embed")},
            **({"experts": _experts(m)} if cfg.num_experts else {}),
            "chat_template": template, "license": None,  # the store keeps no license: the source has it
            "mixed_precision": None if mixed is None else {"tau": mcap.DEFAULT_TAU, "layers": mixed}}


def _experts(m) -> dict:
    """A mixture of experts' shape, as show gives it: experts a layer and a token, the layers
    that have them, the parameters a token runs, and the bytes one expert and a token's experts
    take on disk (each expert one aligned span of its layer's file, layout.expert_span)."""
    from nerva_cli.model.layout import active_parameter_count, expert_bytes

    cfg = m.config
    span = expert_bytes(cfg, m.meta["files"])
    return {"per_layer": cfg.num_experts, "per_token": cfg.experts_per_token, "layers": len(cfg.moe_layers),
            "shared_expert": bool(cfg.shared_expert_intermediate_size), "renormalised": cfg.norm_topk_prob,
            "active_parameters": active_parameter_count(cfg), "expert_bytes": span,
            "expert_bytes_per_token": span * cfg.experts_per_token * len(cfg.moe_layers)}


def _print_show(m, summary: dict, verbose: bool) -> None:
    from collections import Counter

    from nerva_cli.cli import output
    from nerva_cli.model.layout import parameter_size
    from nerva_cli.runtime import mcap

    quant = summary["quantization"]
    kept = f" but {', '.join(quant['f16_matrices'])} F16 (rows not whole blocks)" if "f16_matrices" in quant else ""
    quantisation = (f"{m.variant.upper()} (layer matrices {quant['layer_matrices'].upper()}{kept}, token table "
                    f"{quant['token_table'].upper()})" if m.variant in ("q4_0", "q4_1") else
                    f"{m.variant.upper()} (as converted: runs exact)")
    source = m.meta["source"]
    output.out.print(f"[bold]{output.escape(f'{m.name}:{m.variant}')}[/bold]  {output.escape(str(m.path))}")
    experts = summary.get("experts")
    parameters = parameter_size(summary["parameters"]) + \
        (f" ({parameter_size(experts['active_parameters'])} active a token)" if experts else "")
    output.facts([("architecture", summary["architecture"]), ("parameters", parameters),
                  ("context length", str(summary["context_length"])),
                  ("embedding length", str(summary["embedding_length"])), ("layers", str(summary["layers"])),
                  ("quantization", quantisation),
                  *([("experts", f"{experts['per_layer']} in each of {experts['layers']} layers, "
                                 f"{experts['per_token']} a token"
                                 + (" plus a shared one" if experts["shared_expert"] else "")
                                 + f"; {output.human_bytes(experts['expert_bytes'])} an expert, "
                                   f"{output.human_bytes(experts['expert_bytes_per_token'])} of experts a token")]
                    if experts else []),
                  ("chat template", "yes" if summary["chat_template"] else
                   "none (a base model: prompts go to it as they are)"),
                  ("license", "not kept in the store (the source has it)"),
                  ("source", f"{source.get('kind')}: {source.get('id')}"),
                  ("size", f"{output.human_bytes(m.size)} in {len(m.meta['files'])} files")])
    mixed = summary["mixed_precision"]
    if mixed is not None:
        output.out.print(mcap.precision_line(dict(enumerate(mixed["layers"])), mixed["tau"]), markup=False)
    if not verbose:
        return
    cfg = m.config.to_dict()
    output.facts([*((k, _config_fact(v)) for k, v in cfg.items() if v is not None), ("arch_hash", m.meta["arch_hash"])])
    dtypes = Counter(t["dtype"] for f in m.meta["files"].values() for t in f["tensors"].values())
    largest = max(m.meta["files"].items(), key=lambda kv: kv[1]["size"])
    output.out.print(f"tensors: {sum(dtypes.values())} ({', '.join(f'{n} {d}' for d, n in sorted(dtypes.items()))}); "
                     f"largest file {largest[0]} {output.human_bytes(largest[1]['size'])}")


def _config_fact(value) -> str:
    """A config value for `show`: RoPE's per-frequency factors summarised (64 numbers for a 128-wide
    head; LongRoPE's two lists), anything else as it is (--json gives every value)."""
    if isinstance(value, dict) and value.get("type") == "freq_factors":
        f = value["factors"]
        return f"freq_factors: {len(f)} per-frequency divisors, {min(f):g} to {max(f):g}"
    if isinstance(value, dict) and value.get("type") == "longrope":
        short, long = value["short_factor"], value["long_factor"]
        return (f"longrope: {len(short)} short factors {min(short):g} to {max(short):g}, long {min(long):g} to "
                f"{max(long):g} (past {value['original_max_position_embeddings']} tokens), attention "
                f"factor {value['attention_factor']:g}")
    return str(value)


@app.command()
def rm(models: Annotated[list[str], typer.Argument(help="name or name:variant; a bare name removes every variant, name:latest the one a bare name runs.")]):
    """Remove models from the store."""
    from nerva_cli.cli import output
    from nerva_cli.store import catalog as store

    for ref in models:
        for removed in store.remove(ref, say=output.info):
            output.out.print(f"deleted {removed}", markup=False)
