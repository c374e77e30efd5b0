"""The model store: `$NERVA_HOME/models/<name>/<variant>/`, aligned layer files, metadata.json."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from nerva_cli.model.config import ModelConfig, in_file
from nerva_cli.errors import BadInput, NervaError, NotInStore, read_json

FORMAT = "nerva/1"
ALIGN = 4096
VARIANTS = ("q4_0", "q4_1", "f16", "bf16")
# A bare name picks the first variant the store has in this order: q4_1 exists only where it was
# asked for or where the source was Q4_1, and then it is the one closer to the source.
PICK_ORDER = ("q4_1", "q4_0", "f16", "bf16")
# ollama's tag for "the default": name:latest is the variant a bare name picks
LATEST = "latest"
DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16, "u8": np.uint8, "i8": np.int8}


def home() -> Path:
    return Path(os.environ.get("NERVA_HOME") or Path.home() / ".nerva").expanduser()


def models_root() -> Path:
    return home() / "models"


def store_dir(*parts: str) -> Path:
    """$NERVA_HOME/<parts>, made where missing; a NERVA_HOME that is a file or cannot be written
    is one line naming it, not a traceback from the first mkdir."""
    path = home().joinpath(*parts)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BadInput(f"{e.filename or path}: {e.strerror} (the store, NERVA_HOME={home()}, must be a "
                       "directory nerva can write)") from None
    return path


def check_home() -> None:
    """What reads the store without writing (list, rm) says so when NERVA_HOME is not a directory,
    instead of reporting an empty store."""
    for path in (home(), models_root()):
        if path.exists() and not path.is_dir():
            raise BadInput(f"{path}: not a directory (the store, NERVA_HOME={home()}, must be a directory)")


def temp_dir(target: Path) -> Path:
    """Where a conversion writes before it renames into `target`: a dot name with the writer's
    pid, which tells a later store operation whether its writer is gone (store/locks.sweep)."""
    return target.parent / f".{target.name}.tmp-{os.getpid()}"


TEMP_NAME = re.compile(r"^\.(?P<variant>.+)\.tmp-(?P<pid>\d+)$")


def parse_ref(ref: str) -> tuple[str, str | None]:
    """'name:variant' -> (name, variant or None); the variant in any case (llama.cpp's file names
    say Q4_1); 'name:latest' is a bare name, as in ollama."""
    name, _, variant = ref.partition(":")
    variant = variant.lower()
    if variant == LATEST:
        variant = ""
    if variant and variant not in VARIANTS:
        raise BadInput(f"{ref}: unknown variant '{variant}' (variants: {', '.join(VARIANTS)})")
    if not name or "/" in name or name.startswith("."):
        raise BadInput(f"{ref}: not a model name")
    return name, variant or None


class LayerFileWriter:
    """Writes tensors into one file, each starting at a multiple of ALIGN, hashing as it goes."""

    def __init__(self, path: Path):
        self.path = path
        self.f = open(path, "wb")
        self.sha = hashlib.sha256()
        self.pos = 0
        self.tensors: dict[str, dict] = {}

    def _write(self, data) -> None:
        mv = memoryview(data).cast("B")
        self.f.write(mv)
        self.sha.update(mv)
        self.pos += mv.nbytes

    def _pad(self) -> None:
        if self.pos % ALIGN:
            self._write(bytes(ALIGN - self.pos % ALIGN))

    def add(self, name: str, array: np.ndarray, dtype: str) -> None:
        self._pad()
        array = np.ascontiguousarray(array)
        self.tensors[name] = {"shape": list(array.shape), "dtype": dtype, "offset": self.pos,
                              "nbytes": int(array.nbytes)}
        self._write(array)

    def close(self) -> dict:
        self._pad()
        self.f.close()
        return {"size": self.pos, "sha256": self.sha.hexdigest(), "tensors": self.tensors}


# A file's sha256 is checked on its first load, not on every run: the identity (size, mtime,
# ctime, inode) of each file whose hash matched is kept in this file beside metadata.json, and a
# file whose identity differs from it is hashed again (a write changes mtime and ctime; utime can
# set mtime back, not ctime). Hashing on every run cost every run time, an 8B model's seconds
# (docs/perf/code_figures.md). `nerva show --verify`
# always hashes: it is what finds a file that rots in place, which no write marks. (The pager's
# reader keeps its own identities, per process, for the layers it streams.)
VERIFIED = ".verified.json"


def _identity(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


@dataclass
class StoredModel:
    """A model directory in the store (or anywhere), with its metadata."""

    path: Path
    meta: dict
    _verified: dict | None = field(default=None, repr=False, compare=False)  # VERIFIED's, read once

    @property
    def config(self) -> ModelConfig:
        return ModelConfig.from_dict(self.meta["config"])

    @property
    def name(self) -> str:
        return self.meta.get("name", self.path.parent.name)

    @property
    def variant(self) -> str:
        return self.meta["variant"]

    @property
    def size(self) -> int:
        return sum(f["size"] for f in self.meta["files"].values())

    @property
    def q4_token_table(self) -> bool:
        """Converted before the Q4 variants kept the token table at Q8_0 (it still loads)."""
        return "embed.qs" in self.meta["files"]["embed.bin"]["tensors"]

    def matrix_format(self, fname: str, name: str) -> str:
        """The format matrix `name` of file `fname` was written in (layout.stored_format's, per
        tensor): q4_0, q4_1 or q8_0 by its planes, else its exact dtype."""
        t = self.meta["files"][fname]["tensors"]
        if f"{name}.qs" in t:
            return "q4_1" if f"{name}.m" in t else "q4_0"
        return "q8_0" if f"{name}.q8" in t else t[name]["dtype"]

    def read_file(self, fname: str, verify: bool = True) -> dict[str, np.ndarray]:
        """All tensors of one file as arrays over one buffer, after checking size and sha256."""
        return tensors_in(self.read_bytes(fname, verify), self.meta["files"][fname]["tensors"])

    def map_file(self, fname: str) -> dict[str, np.ndarray]:
        """All tensors of one file as arrays over a private map of it: a page is read when first
        touched (a row of a token table a token) and is the page cache's, not the process's. Size
        and sha256 are checked as read_file does (the hash streamed from the file)."""
        import mmap

        path, info = self.verify_file(fname)
        with open(path, "rb") as f:  # copy-on-write: writable arrays, the types compiled kernels take
            pages = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        return tensors_in(np.frombuffer(pages, dtype=np.uint8), info["tensors"])

    def verify_file(self, fname: str) -> tuple[Path, dict]:
        """Checks one file's size, and its sha256 (streamed from the file) unless this identity of
        it was checked before: what a reader of parts of it (a mapped token table, expert spans)
        checks first. -> (path, its metadata entry)."""
        path, info, st = self._stat(fname)
        if self._verified_identities().get(fname) != _identity(st):
            if _sha256(path) != info["sha256"]:
                raise self.damaged(path, "sha256 disagrees with metadata.json (file changed or corrupt)")
            self._remember_verified(fname, st)
        return path, info

    def read_head(self, fname: str, nbytes: int) -> dict[str, np.ndarray]:
        """The tensors in the first `nbytes` of one file (a MoE layer's dense part, before its
        experts), over a buffer of their own, after verify_file."""
        path, info = self.verify_file(fname)
        buf = np.empty(nbytes, dtype=np.uint8)
        with open(path, "rb") as f:
            got = f.readinto(memoryview(buf))
        if got != nbytes:
            raise self.damaged(path, f"short read ({got} of {nbytes} bytes)")
        return tensors_in(buf, {n: t for n, t in info["tensors"].items() if t["offset"] + t["nbytes"] <= nbytes})

    def _stat(self, fname: str) -> tuple[Path, dict, os.stat_result]:
        """(path, metadata entry, stat) of one file, its size checked against metadata.json."""
        info = self.meta["files"].get(fname)
        if info is None:
            raise BadInput(f"{self.path}: metadata.json lists no file {fname}")
        path = self.path / fname
        try:
            st = path.stat()
        except FileNotFoundError:
            raise self.damaged(path, "missing") from None
        if st.st_size != info["size"]:
            raise self.damaged(path, f"size {st.st_size} disagrees with metadata.json ({info['size']})")
        return path, info, st

    def damaged(self, path, what: str) -> BadInput:
        """The error for a file of this model that is not what metadata.json says: the file, what
        is wrong, and the command that converts the model again (the only repair)."""
        return BadInput(f"{path}: {what}; `{self.repair_command()}` converts the model again")

    def size_damage(self) -> list[str]:
        """Files missing or of another size than metadata.json says, each as 'file: what': the
        check a stat per file affords (pull over a model in the store, list); sha256 is for
        `show --verify` and a file's first load."""
        bad = []
        for fname, info in self.meta["files"].items():
            try:
                size = (self.path / fname).stat().st_size
            except FileNotFoundError:
                bad.append(f"{fname}: missing")
                continue
            if size != info["size"]:
                bad.append(f"{fname}: {size} bytes, metadata.json says {info['size']}")
        return bad

    def repair_command(self) -> str:
        """The command that converts this model again from the source metadata.json names: a pull
        for a model in the store, a convert for a model directory elsewhere."""
        from shlex import quote

        from nerva_cli.store.sources.resolve import ALIASES

        source = self.meta.get("source", {})
        revision = f" --revision {quote(source['revision'])}" if source.get("revision") else ""
        if self.path.resolve().parent.parent != models_root().resolve():
            return (f"nerva convert {quote(str(source.get('id')))} --quant {self.variant} "
                    f"--out {quote(str(self.path))} --force")
        spec = self.name if self.name in ALIASES else f"{quote(str(source.get('id')))} --name {quote(self.name)}"
        return f"nerva pull {spec}{revision} --quant {self.variant} --force"

    def read_bytes(self, fname: str, verify: bool = True, out: np.ndarray | None = None) -> np.ndarray:
        """One file's bytes (into `out`, uint8 of the file's size, when given), after checking
        size and sha256."""
        path, info, st = self._stat(fname)
        if out is not None and (out.dtype != np.uint8 or out.shape != (info["size"],)):
            raise ValueError(f"read_bytes: out must be uint8 of {info['size']} bytes, got {out.dtype} {out.shape}")
        buf = np.empty(info["size"], dtype=np.uint8) if out is None else out
        with open(path, "rb") as f:
            got = f.readinto(memoryview(buf))
        if got != info["size"]:
            raise self.damaged(path, f"short read ({got} of {info['size']} bytes)")
        if verify and self._verified_identities().get(fname) != _identity(st):
            if hashlib.sha256(buf).hexdigest() != info["sha256"]:
                raise self.damaged(path, "sha256 disagrees with metadata.json (file changed or corrupt)")
            self._remember_verified(fname, st)
        return buf

    def _verified_identities(self) -> dict:
        if self._verified is None:
            try:
                known = json.loads((self.path / VERIFIED).read_text())
            except (OSError, ValueError):  # none yet, or unreadable: every file is hashed
                known = {}
            self._verified = known if isinstance(known, dict) else {}
        return self._verified

    def _remember_verified(self, fname: str, st: os.stat_result) -> None:
        """Records a file whose hash matched (written whole, then renamed into place); a model
        directory that cannot be written to is hashed on every load instead."""
        self._verified[fname] = _identity(st)
        tmp = self.path / f"{VERIFIED}.{os.getpid()}.tmp"
        try:
            tmp.write_text(json.dumps(self._verified))
            os.replace(tmp, self.path / VERIFIED)
        except OSError:
            tmp.unlink(missing_ok=True)

    def verify(self) -> list[str]:
        """Names of files whose size or sha256 disagrees with metadata.json."""
        bad = []
        for fname, info in self.meta["files"].items():
            path = self.path / fname
            if not path.exists() or path.stat().st_size != info["size"] or _sha256(path) != info["sha256"]:
                bad.append(fname)
        return bad


def tensors_in(buf: np.ndarray, table: dict) -> dict[str, np.ndarray]:
    out = {}
    for name, t in table.items():
        dtype = DTYPES[t["dtype"]]
        out[name] = buf[t["offset"]: t["offset"] + t["nbytes"]].view(dtype).reshape(t["shape"])
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def load_metadata(model_dir: Path) -> StoredModel:
    path = model_dir / "metadata.json"
    meta = read_json(path)
    if meta.get("format") != FORMAT:
        raise BadInput(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    for key in ("config", "variant", "files"):
        if key not in meta:
            raise BadInput(f"{path}: no '{key}'")
    try:
        ModelConfig.from_dict(meta["config"])  # validates
    except BadInput as e:
        raise in_file(e, path) from None
    return StoredModel(model_dir, meta)


def variants_of(name: str) -> list[str]:
    root = models_root() / name
    return [v for v in VARIANTS if (root / v / "metadata.json").exists()]


def default_variant(have: list[str]) -> str:
    """The variant a bare name (or name:latest) picks among those the store has."""
    return next((v for v in PICK_ORDER if v in have), have[0])


def find_model(ref: str) -> StoredModel:
    """A store reference ('name' or 'name:variant') or a path to a model directory."""
    as_path = Path(ref).expanduser()
    if (as_path / "metadata.json").exists():
        return load_metadata(as_path)
    try:
        name, variant = parse_ref(ref)
    except BadInput as e:  # not a store name at all (a path, a repo id): `run` may pull it
        raise NotInStore(str(e)) from None
    have = variants_of(name)
    if not have:
        check_home()  # a NERVA_HOME that is a file is the news, not an empty store
        raise NotInStore(f"model '{name}' is not in the store ({models_root()}); `nerva pull` it first "
                         "(`nerva list` shows the store)")
    variant = variant or default_variant(have)
    model_dir = models_root() / name / variant
    if not (model_dir / "metadata.json").exists():
        raise NotInStore(f"model '{name}:{variant}' is not in the store ({models_root()}); it has {', '.join(have)}")
    try:
        return load_metadata(model_dir)
    except BadInput as e:
        raise BadInput(f"{e}; `nerva rm {name}:{variant}` removes the broken entry") from None


def find_pulled_from(source_id: str) -> StoredModel | None:
    """The store's model converted from this source (metadata.json's source.id: a path's absolute
    form, a Hub repo's id); where several variants were, the one a bare name picks."""
    found = [m for m in list_models() if m.meta.get("source", {}).get("id") == source_id]
    return min(found, key=lambda m: PICK_ORDER.index(m.variant) if m.variant in PICK_ORDER else len(PICK_ORDER),
               default=None)


def _variant_dirs() -> list[Path]:
    """models/<name>/<variant> directories: a variant's name or one holding metadata.json (not the
    dot-named directories conversions write in)."""
    root = models_root()
    if not root.is_dir():
        return []
    return [d for d in sorted(root.glob("*/*")) if not d.name.startswith(".") and not d.parent.name.startswith(".")
            and d.is_dir() and (d.name in VARIANTS or (d / "metadata.json").exists())]


def list_models() -> list[StoredModel]:
    found = []
    for d in _variant_dirs():
        try:
            found.append(load_metadata(d))
        except BadInput:
            continue  # a broken entry: inventory() and `nerva list` report it
    return found


@dataclass
class BrokenEntry:
    """A variant directory of the store that does not load, or whose files are not the sizes
    metadata.json gives; `error` says which."""

    path: Path
    error: str

    @property
    def name(self) -> str:
        return self.path.parent.name

    @property
    def variant(self) -> str:
        return self.path.name


def inventory() -> tuple[list[StoredModel], list[BrokenEntry]]:
    """Every variant directory of the store: the models that load and whose files have the sizes
    metadata.json gives (a stat per file), and the broken entries, each with why (`nerva list`
    shows both: a broken one left out of the list looked like one that was never there)."""
    check_home()
    good, broken = [], []
    for d in _variant_dirs():
        try:
            model = load_metadata(d)
        except BadInput as e:
            broken.append(BrokenEntry(d, str(e)))
            continue
        damage = model.size_damage()
        if damage:
            broken.append(BrokenEntry(d, f"{d}: {'; '.join(damage)}"))
        else:
            good.append(model)
    return good, broken


def modified(model: StoredModel) -> str:
    return modified_at(model.path)


def modified_at(path: Path) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M", time.localtime(path.stat().st_mtime))
    except OSError:
        return "-"


def remove(ref: str, say=None) -> list[str]:
    """Removes one variant, or every variant of a name (name:latest: the one a bare name runs).
    Returns what was removed. It holds the name's write lock (a pull of the name finishes first)
    and refuses a variant a run holds (store/locks.exclusive)."""
    from contextlib import ExitStack

    from nerva_cli.store import locks

    check_home()
    name, variant = parse_ref(ref)
    root = models_root() / name
    locks.sweep()
    present = []
    if root.is_dir():
        with locks.writing(name, say):
            if variant is None and ref.partition(":")[2]:  # name:latest: the variant `run name:latest` runs
                have = variants_of(name)
                targets = [default_variant(have)] if have else []
            else:  # a bare name: every variant directory, broken ones too
                targets = [variant] if variant else list(VARIANTS)
            present = [v for v in targets if (root / v).is_dir()]
            with ExitStack() as held:  # every variant checked before any is removed
                for v in present:
                    held.enter_context(locks.exclusive(root / v, f"{name}:{v}"))
                for v in present:
                    shutil.rmtree(root / v)
            if not any(root.iterdir()):
                root.rmdir()
    if not present:
        raise NervaError(f"model '{ref}' is not in the store ({models_root()})")
    return [f"{name}:{v}" for v in present]
