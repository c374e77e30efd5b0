"""numba's disk cache across the kernels' modules: numba stamps a cached function with its own
file's source, so a kernel calling a function of another file kept the machine code built from
that file's old source when only that file changed (numba issue 1833). numba_setup stamps every
function cached from the kernels folder with the whole folder's sources instead."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from numba.core.caching import FunctionCache
from numba.core.dispatcher import Dispatcher

from nerva_cli.planes.cpu import kernels as cpu
from nerva_cli.planes.cpu.kernels import (
    decode_attention as cpu_decode_attention, disk_cache as cpu_disk_cache, numba_setup as cpu_numba_setup)

# a two-file package stamped as the kernels folder is: a kernel in one file, what it calls in another
PACKAGE = """
import os

from nerva_cli.planes.cpu.kernels.numba_setup import stamp_caches_by_folder

stamp_caches_by_folder(os.path.dirname(os.path.abspath(__file__)))
"""

HELPER = """
from numba import njit


@njit(cache=True)
def step():
    return {}
"""

KERNEL = """
from numba import njit

from stamped.helper import step


@njit(cache=True)
def advance(x):
    return x + step()
"""

RUN = """
from stamped.kernel import advance

print(advance(1), len(advance.stats.cache_hits))
"""


def test_an_edited_helper_recompiles_the_kernel_that_calls_it(tmp_path):
    """The first process compiles the kernel, the second loads it from the disk cache; then only
    the helper's file changes, and the third process must compile the kernel again and give the
    new helper's result, not load the cached code built with the old one."""
    package = tmp_path / "stamped"
    package.mkdir()
    (package / "__init__.py").write_text(PACKAGE)
    (package / "kernel.py").write_text(KERNEL)
    (package / "helper.py").write_text(HELPER.format(1))
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([str(tmp_path), os.getcwd(), os.environ.get("PYTHONPATH", "")]))

    def run() -> str:
        out = subprocess.run([sys.executable, "-c", RUN], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    assert run() == "2 0"  # compiled
    assert run() == "2 1"  # from the disk cache
    kernel = os.stat(package / "kernel.py")
    (package / "helper.py").write_text(HELPER.format(5))
    assert os.stat(package / "kernel.py").st_mtime_ns == kernel.st_mtime_ns  # the kernel's file as it was
    assert run() == "6 0"  # compiled again with the new helper


def test_every_cached_kernel_and_the_warm_marker_take_the_folders_stamp(monkeypatch):
    """Every function the kernels' modules cache (the decode attention's made on demand too) is
    stamped with the whole folder's sources, and warm_marker's file name follows that stamp."""
    stamp = cpu_numba_setup.folder_stamp(cpu_numba_setup.KERNELS)
    cpu.attention_kernel(9, 3)  # made on first use
    modules = [m for name, m in sys.modules.items() if name.startswith(cpu.__name__ + ".")]
    kernels = {obj for m in modules for obj in vars(m).values() if isinstance(obj, Dispatcher)}
    kernels |= set(cpu_decode_attention._attention_kernels.values())  # one for each pair of pack sizes made
    sources = [path.read_text() for path in Path(cpu_numba_setup.KERNELS).glob("*.py")]
    decorated = sum(len(re.findall(r"^ *@njit\(", source, re.M)) for source in sources)
    assert len({k.py_func.__code__ for k in kernels}) == decorated  # every kernel the sources define
    assert all(isinstance(k._cache, FunctionCache) for k in kernels)
    assert {k._cache._cache_file._source_stamp for k in kernels} == {stamp}
    marker = cpu.warm_marker("w4a8")
    monkeypatch.setattr(cpu_disk_cache, "folder_stamp", lambda folder: "another source")
    assert cpu.warm_marker("w4a8") != marker


def test_a_folders_cache_directory_is_checked_once_for_all_its_functions(tmp_path, monkeypatch):
    """numba writes a temporary file into a function's cache directory to see that it can, for
    each function (0.7 ms each, 49 at the kernels' import); a stamped folder's functions share
    one directory, checked once."""
    import importlib.util
    import tempfile

    from numba.core import config

    folder = tmp_path / "twice"
    folder.mkdir()
    (folder / "two.py").write_text("from numba import njit\n\n\n@njit(cache=True)\ndef one():\n    return 1\n\n\n"
                                   "@njit(cache=True)\ndef two():\n    return 2\n")
    monkeypatch.setattr(config, "CACHE_DIR", str(tmp_path / "cache"))
    checks = []
    make = tempfile.TemporaryFile
    monkeypatch.setattr(tempfile, "TemporaryFile", lambda *a, **k: checks.append(k.get("dir")) or make(*a, **k))
    cpu_numba_setup.stamp_caches_by_folder(str(folder))
    spec = importlib.util.spec_from_file_location("twice_two", folder / "two.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    paths = {f._cache._cache_path for f in (module.one, module.two)}
    assert len(paths) == 1 and checks == list(paths)
    assert module.one() + module.two() == 3
