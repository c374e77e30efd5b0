"""numba as the kernels need it, set up before any kernel module defines a kernel (the package
imports this module first): the disk cache's directory (numba reads NUMBA_CACHE_DIR once, when it
is first imported), numba's registries loaded only to compile, saves to the cache taken in turn,
each cached kernel stamped with the whole kernels folder's sources, the fast-math flags, and the
thread count."""

from __future__ import annotations

import functools
import hashlib
import os
import sys


if "NUMBA_CACHE_DIR" not in os.environ:
    home = os.path.expanduser(os.environ.get("NERVA_HOME") or "~/.nerva")
    os.environ["NUMBA_CACHE_DIR"] = os.path.join(home, "numba-cache")
    if "numba" in sys.modules:  # numba reads its environment once, when first imported
        sys.modules["numba"].core.config.reload_config()


def _import_numba_without_optional_imports() -> None:
    """Imports numba with two of its import-time imports failing fast, as
    _refresh_without_optional_imports does for its registries: scipy, which numba imports only to
    refuse a version before 1.0 (0.04 s where scipy is installed), and PyYAML, which it uses only
    to read a `.numba_config.yaml` in the working directory (0.05 s), hidden only where there is
    none, so numba's configuration is what it would have been (docs/perf/startup_epyc_zen3.md)."""
    optional = ("scipy",) if os.path.isfile(".numba_config.yaml") else ("scipy", "yaml")
    hidden = [name for name in optional if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # `import scipy` raises ImportError at once
    try:
        import numba  # noqa: F401
    finally:
        for name in hidden:
            del sys.modules[name]


_import_numba_without_optional_imports()

import numba  # noqa: E402
import numpy as np  # noqa: E402


def _refresh_without_optional_imports(target_context) -> None:
    """Loads numba's typing and lowering registries, in numba's order, with two of their imports
    failing fast: they serve nothing here. Its NumPy support probes for scipy's BLAS by importing
    scipy.linalg, which is slow where scipy is installed (as on this project's machines). Its
    cffi support makes a cffi.FFI(), which imports pycparser where cffi is installed
    (docs/perf/code_figures.md). No kernel here uses either: their GEMMs call NumPy's
    OpenBLAS through an address of their own (_sgemm), and nothing compiled calls a cffi
    function. numba's own np.dot still imports scipy.linalg when one compiles; numba's cffi
    support stays off in this process (it looks for cffi once), while cffi itself imports as
    before."""
    hidden = [name for name in ("scipy.linalg", "cffi") if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # `import scipy.linalg...` raises ImportError at once
    try:
        target_context.refresh()
    finally:
        for name in hidden:
            del sys.modules[name]


def _load_numba_registries_only_to_compile() -> None:
    """numba loads its registries before it loads a function from its disk cache, though cached
    machine code needs only numba's runtime (NRT, whose symbols it links against). Here a cache
    load initialises the runtime alone, and the registries load at the first miss, which numba
    compiles next; a function without a disk cache compiles as before (numba's compiler loads
    them itself, optional imports included). A warm run leaves 62 of numba's modules unimported
    (cached code's environments still import a dozen, numba.np.arrayobj's among them), which
    shortens a warm run (docs/perf/code_figures.md)."""
    try:
        from numba.core.caching import Cache
        from numba.core.cpu import CPUContext
        from numba.core.runtime import rtsys

        load_with_registries = Cache.load_overload
        Cache._load_overload, Cache._guard_against_spurious_io_errors  # noqa: B018  (what the patch calls)
    except (ImportError, AttributeError):  # numba moved them: the registries load now, as numba would
        from numba.core.registry import cpu_target

        _refresh_without_optional_imports(cpu_target.target_context)
        return
    registries_loaded = []

    def load_overload(self, sig, target_context):
        if registries_loaded or not isinstance(target_context, CPUContext):  # rtsys is the CPU's runtime
            return load_with_registries(self, sig, target_context)
        rtsys.initialize(target_context)
        found = None
        with self._guard_against_spurious_io_errors():
            found = self._load_overload(sig, target_context)
        if found is None:
            _refresh_without_optional_imports(target_context)
            registries_loaded.append(True)
        return found

    Cache.load_overload = load_overload


_load_numba_registries_only_to_compile()


def _serialise_numba_cache_saves() -> None:
    """numba adds a compiled overload to its disk cache by reading the function's index, adding
    the entry and writing the index back, with nothing held between: two nerva processes
    compiling one function for different types at once (a first run of two variants side by
    side) lose one entry, which a later run compiles again, or, where their writes interleave
    unluckily, map one entry to the other's code. A lock on the cache directory for the length of
    each save keeps them in turn (a test makes the window wide and sees both entries kept)."""
    try:
        import fcntl
        from numba.core.caching import IndexDataCacheFile
    except ImportError:  # not POSIX, or numba moved it: saves as numba makes them
        return
    save = IndexDataCacheFile.save

    def save_in_turn(self, key, data):
        try:
            lock = open(os.path.join(os.path.dirname(self._index_path), ".nerva-save.lock"), "a")
        except OSError:  # numba raises what a save raises on POSIX: never let the lock be why
            return save(self, key, data)
        with lock:  # closing it releases the lock
            try:
                fcntl.flock(lock, fcntl.LOCK_EX)
            except OSError:  # a filesystem without locks (some NFS): saves as numba makes them
                pass
            return save(self, key, data)

    IndexDataCacheFile.save = save_in_turn


_serialise_numba_cache_saves()


@functools.lru_cache(maxsize=None)
def folder_stamp(folder: str) -> str:
    """A digest of the names and contents of every .py file in `folder`, taken once a process (the
    sources it imported): the source stamp of every function cached from a folder given to
    stamp_caches_by_folder, and of warm_marker's file."""
    digest = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            with open(os.path.join(folder, name), "rb") as f:
                source = f.read()
            digest.update(b"%s\0%d\0%s" % (name.encode(), len(source), source))
    return digest.hexdigest()


_STAMPED_FOLDERS: set = set()


_WRITABLE: set = set()  # cache directories a locator found writable in this process


class _FolderStamped:
    """Mixed in before one of numba's cache locators (which says where the cache lives): takes
    only the functions of a folder given to stamp_caches_by_folder, and stamps them with the whole
    folder's sources (folder_stamp) in place of their own file's. A folder's functions share one
    cache directory, which numba checks for each (makedirs and a temporary file written: 0.7 ms
    a function, 49 of them at import); here the first check stands for the rest."""

    @classmethod
    def from_function(cls, py_func, py_file):
        if os.path.dirname(os.path.abspath(py_file)) not in _STAMPED_FOLDERS:
            return None
        return super().from_function(py_func, py_file)

    def ensure_cache_path(self):
        path = self.get_cache_path()
        if path not in _WRITABLE:
            super().ensure_cache_path()  # raises OSError where it is not: numba then tries the next locator
            _WRITABLE.add(path)

    def get_source_stamp(self):
        return folder_stamp(os.path.dirname(os.path.abspath(self._py_file)))


def stamp_caches_by_folder(folder: str) -> None:
    """numba keys each cached function on its own file's source alone, so a kernel that inlines or
    calls code of another file (an intrinsic's IR, a helper kernel) would keep machine code built
    from that file's old code when only that file changed (numba issue 1833). From here on, each
    function numba caches from a .py file in `folder` is stamped with the whole folder's sources:
    an edit to any of them and numba compiles them all again. Call it before the folder's
    functions are defined: numba picks a function's locator when @njit(cache=True) runs."""
    _STAMPED_FOLDERS.add(os.path.abspath(folder))
    try:
        from numba.core import caching

        # numba 0.68's names; older versions begin them with an underscore
        impl = getattr(caching, "CacheImpl", None) or caching._CacheImpl
        bases = [getattr(caching, name, None) or getattr(caching, "_" + name)
                 for name in ("UserProvidedCacheLocator", "InTreeCacheLocator", "UserWideCacheLocator")]
        impl._locator_classes  # noqa: B018  (what the patch extends)
    except AttributeError:  # numba moved them: each function stamped by its own file, as numba does
        return  # (tests/test_kernel_cache_stamp.py then fails)
    if not any(issubclass(locator, _FolderStamped) for locator in impl._locator_classes):
        impl._locator_classes[:0] = [type(f"FolderStamped{base.__name__.lstrip('_')}", (_FolderStamped, base),
                                          {"__module__": __name__}) for base in bases]


KERNELS = os.path.dirname(os.path.abspath(__file__))
stamp_caches_by_folder(KERNELS)

F32 = np.float32
# Fast-math: `_FAST` allows reassociation (so reductions vectorise) and FMA contraction, but not
# the no-NaN/no-inf assumptions, so inf and NaN still propagate as IEEE says.
_FAST = {"reassoc", "contract"}


def set_threads(n: int) -> None:
    """Threads for the parallel kernels, 1..the cores numba saw at start."""
    most = numba.config.NUMBA_NUM_THREADS
    if not 1 <= n <= most:
        raise ValueError(f"threads must be between 1 and {most}, got {n}")
    numba.set_num_threads(n)
    _threads[0] = n


_threads = [numba.get_num_threads()]  # set_threads's, kept here: numba's getter is slow a call
# (docs/perf/code_figures.md)
