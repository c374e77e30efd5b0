"""The CUDA sources (kernels/*.cu): where they live and how they compile, with NVRTC (the
`nvidia-cuda-nvrtc` wheel) straight to a cubin. The cuda backend loads what compile_cubin makes
for its GPU; CI runs the same call for every architecture nerva supports, so a kernel that does
not build never reaches a GPU machine."""

from __future__ import annotations

import ctypes
import glob
import os
import re
from pathlib import Path

from nerva_cli.errors import NervaError

KERNEL_DIR = Path(__file__).resolve().parents[3] / "kernels"
ARCHES = ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90")  # Turing .. Hopper (ARCHITECTURE 7)
# IEEE division and square root: the activation quantiser must match the NumPy reference bit
# for bit, so no fast math.
OPTIONS = ("--std=c++17",)
DECLARED = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(')
INCLUDE = re.compile(r'^#include "([\w.]+)"$', re.MULTILINE)


def sources() -> dict[str, Path]:
    """Module name -> .cu path, e.g. {"matvec": .../kernels/matvec.cu}."""
    found = {p.stem: p for p in sorted(KERNEL_DIR.glob("*.cu"))}
    if not found:
        raise NervaError(f"{KERNEL_DIR}: no CUDA sources (*.cu) found; is the checkout complete?")
    return found


def declared_kernels(path: Path) -> list[str]:
    """The `extern "C" __global__` kernels a source defines."""
    return DECLARED.findall(path.read_text())


def module_source(path: Path) -> str:
    """The source with its local headers inlined: CuPy's kernel cache keys on the source text
    alone, so an edited header has to change that text."""
    def inline(m):
        return (KERNEL_DIR / m.group(1)).read_text().replace("#pragma once\n", "")

    return INCLUDE.sub(inline, path.read_text())


def _nvrtc(major: int | None = None) -> ctypes.CDLL:
    """libnvrtc from the nvidia-cuda-nvrtc wheel (CUDA 13 or 12 layout), else a CUDA toolkit's;
    with `major`, that CUDA major version's first (a cubin from a newer major than the
    driver's CUDA may not load)."""
    import importlib.util

    candidates = []
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidates += sorted(glob.glob(os.path.join(root, "cu13", "lib", "libnvrtc.so*")))
        candidates += sorted(glob.glob(os.path.join(root, "cuda_nvrtc", "lib", "libnvrtc.so*")))
    for toolkit in filter(None, (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda")):
        candidates += sorted(glob.glob(os.path.join(toolkit, "lib64", "libnvrtc.so*")))
    candidates += ["libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"]
    if major is not None:
        candidates.sort(key=lambda c: f"libnvrtc.so.{major}" not in c)  # stable: the rest keep their order
    for c in candidates:
        if "builtins" in c:
            continue
        try:
            return ctypes.CDLL(c)
        except OSError:
            continue
    raise NervaError("NVRTC not found: pip install nvidia-cuda-nvrtc (CUDA 13) or nvidia-cuda-nvrtc-cu12")


def nvrtc_version(major: int | None = None) -> str:
    lib = _nvrtc(major)
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return f"{major.value}.{minor.value}"


def compile_cubin(path: Path, arch: str, major: int | None = None, defines: tuple[str, ...] = ()) -> bytes:
    """NVRTC-compiles one source to machine code for `arch` (e.g. sm_90), through ptxas, so
    register and shared-memory limits are checked too. A failure raises with NVRTC's log, which
    names the file and line. defines ("MV_ROWS=4", ...): tuning sweeps (scripts/gpu_matvec_sweep.py)."""
    return _compile(path, arch, major, defines, verbose=False)[0]


SPILLS = re.compile(r"Function properties for (\w+)\n.*?(\d+) bytes stack frame, (\d+) bytes spill stores, "
                    r"(\d+) bytes spill loads\n.*?Used (\d+) registers")


def resources(path: Path, arch: str, defines: tuple[str, ...] = ()) -> dict[str, dict[str, int]]:
    """What ptxas gave each kernel of one source for `arch`: {kernel: {registers, stack,
    spill_stores, spill_loads}} (bytes a thread). A spill is local memory: on a decode kernel
    bound by bytes in flight, reloads in its loop cost issue slots and latency (scripts/sass_mix.py
    shows where they land)."""
    log = _compile(path, arch, None, defines, verbose=True)[1]
    return {m[0]: {"registers": int(m[4]), "stack": int(m[1]), "spill_stores": int(m[2]), "spill_loads": int(m[3])}
            for m in SPILLS.findall(log)}


def _compile(path: Path, arch: str, major: int | None, defines: tuple[str, ...], verbose: bool) -> tuple[bytes, str]:
    """(cubin, NVRTC's log); verbose: ptxas reports each kernel's registers and spills in the log."""
    lib = _nvrtc(major)
    prog = ctypes.c_void_p()
    src = module_source(path).encode()
    check = _checker(lib, path)
    check(lib.nvrtcCreateProgram(ctypes.byref(prog), src, str(path).encode(), 0, None, None))
    try:
        opts = [o.encode() for o in (*OPTIONS, f"--gpu-architecture={arch}", *(f"-D{d}" for d in defines),
                                     *(("--ptxas-options=--verbose",) if verbose else ()))]
        arr = (ctypes.c_char_p * len(opts))(*opts)
        rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        text = log.value.decode(errors="replace").strip()
        if rc != 0:
            raise NervaError(f"{path}: NVRTC failed for {arch}:\n{text}")
        check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)))
        cubin = ctypes.create_string_buffer(size.value)
        check(lib.nvrtcGetCUBIN(prog, cubin))
        return cubin.raw, text
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _checker(lib, path):
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p

    def check(rc: int) -> None:
        if rc != 0:
            raise NervaError(f"{path}: NVRTC error {lib.nvrtcGetErrorString(rc).decode()}")

    return check
