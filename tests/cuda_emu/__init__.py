"""CUDA C kernels run on the CPU (see emu.h), behind CuPy's RawModule/RawKernel calling
convention, so CI without a GPU checks kernels/*.cu and drives them with the real launch code.

    mod = EmuModule([Path("kernels/norm.cu")], include_dir=Path("kernels"), cache_dir=tmp)
    mod.get_function("rmsnorm")((rows,), (256,), (x, w, np.float32(1e-5), out, np.int32(n)))

Scalars must be numpy scalars of exactly the parameter's type: CuPy passes a Python int as 64
bits and a float as a double, which a kernel taking int or float misreads without a word.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import subprocess
import threading
from pathlib import Path

import numpy as np

EMU_H = Path(__file__).with_name("emu.h")
# Launches of one library take turns (its __shared__ statics and fiber scheduler are global).
# Modules built in the same cache load the same library, so the locks go by its path.
_LIB_LOCKS: dict[Path, threading.Lock] = {}
_LIB_LOCKS_GUARD = threading.Lock()
# -O1 leaves strict aliasing off (only -O2 turns it on), which the kernels' uint4/float4 casts
# of byte pointers rely on, as CUDA does; -fno-strict-aliasing says so outright. The sanitizer
# flags make every access of a kernel call emu.h's checks (its header says which); -g1 gives
# addr2line the source line of an access they refuse. The library is linked apart, without
# them: g++ would add the sanitizers' runtimes, whose hooks emu.h replaces.
FLAGS = ["-std=c++20", "-O1", "-g1", "-pthread", "-fPIC", "-fno-strict-aliasing", "-fvisibility=hidden",
         "-fsanitize=thread", "--param", "tsan-instrument-func-entry-exit=0", "-fsanitize=alignment"]
LINK_FLAGS = ["-shared", "-pthread", "-Wl,-z,defs"]  # a hook emu.h lacks fails here, not at a launch
KERNEL = re.compile(r'extern\s+"C"\s+__global__\s+(?:__launch_bounds__\s*\(([^)]*)\)\s*)?void\s+'
                    r'(?:__launch_bounds__\s*\(([^)]*)\)\s*)?(\w+)\s*\(([^)]*)\)')
QUALIFIERS = {"const", "volatile", "__restrict__", "__restrict", "restrict"}


def _scalar_types() -> dict[str, np.dtype]:
    t = {"float": np.float32, "double": np.float64, "bool": np.bool_, "size_t": np.uint64,
         "signed": np.int32, "unsigned": np.uint32, "char": np.int8}  # plain char is signed on x86
    for base, bits in (("char", 8), ("short", 16), ("int", 32), ("long", 64), ("long long", 64)):
        for name in (base, f"{base} int"):
            if name != "char int":
                t.setdefault(name, getattr(np, f"int{bits}"))
                t[f"signed {name}"] = getattr(np, f"int{bits}")
                t[f"unsigned {name}"] = getattr(np, f"uint{bits}")
    for bits in (8, 16, 32, 64):
        t[f"int{bits}_t"], t[f"uint{bits}_t"] = getattr(np, f"int{bits}"), getattr(np, f"uint{bits}")
    return {k: np.dtype(v) for k, v in t.items()}


SCALARS = _scalar_types()


class EmuBuildError(RuntimeError):
    pass


class EmuKernelError(RuntimeError):
    """A launch that could not finish: a block deadlocked (threads returned, or wait at another
    barrier, while others wait at __syncthreads or a warp shuffle), a shuffle or __syncwarp
    had a mask other than the whole warp's, a block had more threads than the kernel's launch
    bounds, or emu.h's memory checks refused an access: outside the thread's stack, shared memory
    and the launch's arrays, through a misaligned pointer, or racing with another thread's or
    block's; in a dependent launch (EmuModule's dependent_launches), a store or a read other than
    weights() before the thread's wait_prior_kernels()."""


class Param:
    def __init__(self, kernel: str, index: int, text: str):
        words = text.replace("*", " * ").split()
        self.kernel, self.index, self.text = kernel, index, text
        self.pointer = "*" in words
        self.const = "const" in words[:words.index("*")] if self.pointer else True  # the pointee's const
        base = " ".join(w for w in words[:-1] if w not in QUALIFIERS and w != "*")  # last word: name
        self.dtype = None if self.pointer else SCALARS.get(base)
        if not self.pointer and self.dtype is None:
            raise ValueError(f"kernel {kernel}: parameter {index} `{text}` has a type the emulator does not map")

    @property
    def code(self) -> str:  # emu::signature_is's letters: the compiler checks this parse
        return "p8" if self.pointer else {"b": "u"}.get(self.dtype.kind, self.dtype.kind) + str(self.dtype.itemsize)

    @property
    def where(self) -> str:
        return f"kernel {self.kernel} parameter {self.index} `{self.text}`"

    def store(self, arg, slot: np.ndarray) -> int:
        """Writes the argument's bytes to its slot (one element) of the kernel's argument block,
        after the checks CuPy does not make; -> the bytes of an array argument (0 for a scalar).
        Whatever it allocates is gone when it returns: the decode hot-path test
        (nerva_cli/runtime/hotpath.py) counts what a launch holds at its peak."""
        if self.pointer:
            if not isinstance(arg, np.ndarray):
                if not hasattr(arg, "__array_interface__"):
                    raise TypeError(f"{self.where}: expected a numpy array, got {type(arg).__name__}")
                arg = np.asarray(arg)  # a view: __array_interface__ objects are not copied
            if not arg.flags.c_contiguous:
                raise TypeError(f"{self.where}: array is not C-contiguous")
            if not self.const and not arg.flags.writeable:
                raise TypeError(f"{self.where}: the kernel may write through it, but the array is read-only")
            slot[0] = arg.ctypes.data
            return arg.nbytes
        if isinstance(arg, np.generic) and arg.dtype == self.dtype:
            slot[0] = arg
            return 0
        got = f"numpy {arg.dtype}" if isinstance(arg, np.generic) else f"Python {type(arg).__name__}"
        raise TypeError(f"{self.where}: expected a numpy {self.dtype} scalar, got {got}")


def parse(source: str) -> dict[str, tuple[list[Param], str]]:
    """Kernel name -> (its parameters, its most threads a block: __launch_bounds__'s first
    argument as written, or 1024)."""
    text = re.sub(r"//[^\n]*|/\*.*?\*/", " ", source, flags=re.S)
    return {name: ([Param(name, i, p.strip()) for i, p in enumerate(params.split(",")) if p.strip()],
                   (before or after or "1024").split(",")[0].strip())
            for before, after, name, params in KERNEL.findall(text)}


def _dims(v) -> tuple[int, int, int]:
    v = (v,) if isinstance(v, (int, np.integer)) else tuple(v)
    if not 1 <= len(v) <= 3 or not all(isinstance(d, (int, np.integer)) and d >= 1 for d in v):
        raise ValueError(f"grid and block are 1 to 3 positive ints, got {v!r}")
    return tuple(int(d) for d in v) + (1,) * (3 - len(v))


def _source_of(so: Path, offset: int) -> str:
    """Where in the kernel source the library's code at offset is, innermost inlined call first."""
    try:
        done = subprocess.run(["addr2line", "-f", "-i", "-C", "-e", str(so), hex(offset)],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return f"+{offset:#x} in {so.name} (addr2line did not run)"
    lines = done.stdout.split("\n")
    frames = [f"{Path(where.split(' (discriminator')[0]).name} ({func.split('(')[0]})"
              for func, where in zip(lines[::2], lines[1::2]) if where]
    return ", inlined in ".join(frames[:4]) or f"+{offset:#x} in {so.name}"


@functools.lru_cache(maxsize=None)
def _data_symbols(so: Path) -> list[tuple[int, int, str]]:
    """(offset, size, name) of the library's data symbols: __shared__ statics among them."""
    try:
        done = subprocess.run(["nm", "-C", "-S", "--defined-only", str(so)], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    rows = (line.split(maxsplit=3) for line in done.stdout.splitlines())
    return [(int(r[0], 16), int(r[1], 16), r[3]) for r in rows if len(r) == 4 and r[2] in "bBdD"]


def _data_of(so: Path, offset: int) -> str:
    """The variable at the library's offset, as 'name, byte N'."""
    for start, size, name in _data_symbols(so):
        if start <= offset < start + size:
            return f"{name}, byte {offset - start}"
    return f"+{offset:#x} in {so.name}"


class EmuKernel:
    def __init__(self, name: str, params: list[Param], lib: ctypes.CDLL, lock: threading.Lock, so: Path):
        self.name, self.params, self._lock, self._so = name, params, lock, so
        self._fn = getattr(lib, f"emu_{name}")
        self._fn.argtypes = [ctypes.c_uint] * 6 + [ctypes.c_void_p, ctypes.c_void_p]
        self._fn.restype = ctypes.c_char_p  # null, or why the launch failed

    def _explain(self, error: str) -> str:
        """emu.h's message with each parameter's declaration, variable's name and code's source line."""
        error = re.sub(r"parameter (\d+)", lambda m: f"parameter {m[1]} `{self.params[int(m[1])].text}`", error)
        error = re.sub(r"\[data \+0x([0-9a-f]+)\]", lambda m: _data_of(self._so, int(m[1], 16)), error)
        return re.sub(r"\[pc \+0x([0-9a-f]+)\]", lambda m: "at " + _source_of(self._so, int(m[1], 16)), error)

    def __call__(self, grid, block, args, *, shared_mem: int = 0, stream=None):
        if shared_mem:
            raise ValueError(f"kernel {self.name}: dynamic shared memory is not emulated")
        self.prepare(grid, block, args)()

    def prepare(self, grid, block, args):
        """The launch checked and its arguments packed once (8 bytes a parameter, and the void*
        array pointing at them); -> a call that runs it. A captured graph replays these, so a
        replay makes next to no Python objects (the hot-path allocation count stays the engine's)."""
        grid, block = _dims(grid), _dims(block)
        n = block[0] * block[1] * block[2]
        if n % 32 or n > 1024:
            raise ValueError(f"kernel {self.name}: the emulator needs whole warps (<= 1024 threads), block {block}")
        if not isinstance(args, tuple) or len(args) != len(self.params):
            raise TypeError(f"kernel {self.name} takes {len(self.params)} arguments as a tuple, got {args!r:.200}")
        packed = np.zeros(len(self.params), np.uint64)
        extents = np.zeros(2 * len(self.params), np.uint64)  # [lo, hi) of each array argument
        for i, (p, a) in enumerate(zip(self.params, args)):
            nbytes = p.store(a, packed[i:i + 1] if p.pointer else packed[i:i + 1].view(p.dtype)[:1])
            if p.pointer:
                extents[2 * i:2 * i + 2] = packed[i], int(packed[i]) + nbytes
        argv = (ctypes.c_void_p * len(self.params))(*(packed.ctypes.data + 8 * i for i in range(len(self.params))))
        dims, fn, lock, name, bounds = (*grid, *block), self._fn, self._lock, self.name, extents.ctypes.data

        def launch():
            with lock:  # one launch at a time per library (see _LIB_LOCKS)
                error = fn(*dims, argv, bounds)
            if error is not None:
                raise EmuKernelError(f"kernel {name} grid {grid} block {block}: {self._explain(error.decode())}")

        launch.keep = (args, packed, extents)  # the arrays and packed bytes live as long as the call
        return launch


class EmuModule:
    """dependent_launches: every launch runs as a programmatic dependent, as the cuda backend
    launches kernels/*.cu on a GPU that takes it, so a thread's store, or read other than through
    weights(), before its wait_prior_kernels() (common.cuh) ends the launch with an error."""

    def __init__(self, sources: list[Path], include_dir: Path, cache_dir: Path | None = None,
                 dependent_launches: bool = False):
        cache_dir = Path(cache_dir or Path.home() / ".cache" / "nerva-emu")
        cache_dir.mkdir(parents=True, exist_ok=True)
        include_dir = Path(include_dir).resolve()
        # headers join the key: a changed common.cuh must not reuse a stale build
        headers = b"".join(p.name.encode() + p.read_bytes() for p in sorted(include_dir.iterdir())
                           if p.suffix in (".cuh", ".h", ".hpp") and p.is_file())
        builds, self._kernels = [], {}
        for src in map(lambda s: Path(s).resolve(), sources):
            text = src.read_text()
            kernels = parse(text)
            # one library per source, as one module per source on the GPU: common.cuh's
            # non-inline __device__ functions then do not clash between sources
            gen = f'#include "{src}"\n' + "".join(
                f'static_assert(emu::signature_is({k}, "{"".join(p.code for p in ps)}"),'
                f' "{k}: parameters differ from what tests/cuda_emu parsed");\n'
                f'extern "C" __attribute__((visibility("default"))) const char* emu_{k}(unsigned gx, unsigned gy,'
                f' unsigned gz, unsigned bx, unsigned by, unsigned bz, void** args, const unsigned long long* extents)'
                f' {{ return emu::launch({k}, {{gx, gy, gz}}, {{bx, by, bz}}, args, extents, unsigned({bound}),'
                f' {"true" if dependent_launches else "false"}); }}\n'
                for k, (ps, bound) in kernels.items())
            key = hashlib.sha256(b"\0".join([text.encode(), EMU_H.read_bytes(), headers, gen.encode(),
                                             " ".join(FLAGS + LINK_FLAGS).encode()])).hexdigest()[:20]
            so = cache_dir / f"{src.stem}-{key}.so"
            if not so.exists():
                cpp = cache_dir / f"{src.stem}-{key}.cpp"
                cpp.write_text(gen)
                tmp = so.with_suffix(f".{os.getpid()}.tmp")  # renamed into place: parallel runs are safe
                cmd = ["g++", *FLAGS, "-I", str(include_dir), "-include", str(EMU_H), "-c", str(cpp), "-o",
                       str(tmp.with_suffix(".o"))]
                builds.append((src, so, tmp, subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)))
            self._kernels.update({k: (ps, so) for k, (ps, _) in kernels.items()})
        failed = []
        for src, so, tmp, proc in builds:  # the sources compile side by side
            err = proc.communicate()[1]
            obj = tmp.with_suffix(".o")
            if not proc.returncode:
                link = subprocess.run(["g++", *LINK_FLAGS, str(obj), "-o", str(tmp)], stderr=subprocess.PIPE, text=True)
                err = link.stderr
            obj.unlink(missing_ok=True)
            if proc.returncode or link.returncode:
                failed.append(f"g++ failed on {src}:\n{err}")
            else:
                os.replace(tmp, so)
        if failed:
            raise EmuBuildError("\n".join(failed))
        with _LIB_LOCKS_GUARD:
            self._libs = {so: (ctypes.CDLL(str(so)), _LIB_LOCKS.setdefault(so, threading.Lock()))
                          for _, so in self._kernels.values()}

    def get_function(self, name: str) -> EmuKernel:
        if name not in self._kernels:
            raise KeyError(f'no kernel {name!r} (declared as extern "C" __global__ void NAME(...)); '
                           f"have {sorted(self._kernels)}")
        params, so = self._kernels[name]
        return EmuKernel(name, params, *self._libs[so], so)
