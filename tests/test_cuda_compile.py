"""Every CUDA source compiles with NVRTC, through ptxas, for every supported architecture, and
every kernel it declares is in the machine code; ptxas's register and spill report is read; the
inline PTX's one truth table is what its C fallback computes: no GPU needed (ARCHITECTURE 7)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from nerva_cli.planes.cuda import nvrtc as kernels


@pytest.mark.parametrize("arch", kernels.ARCHES)
@pytest.mark.parametrize("name", sorted(kernels.sources()))
def test_source_compiles_for_arch(name, arch):
    path = kernels.sources()[name]
    cubin = kernels.compile_cubin(path, arch)
    declared = kernels.declared_kernels(path)
    assert declared, f"{path} declares no kernel"
    for k in declared:
        assert k.encode() in cubin, f"{k} from {path} is missing from the {arch} machine code"


def test_compile_error_names_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.cu"
    bad.write_text('extern "C" __global__ void k(float* x) {\n  x[0] = undefined_name;\n}\n')
    with pytest.raises(Exception) as e:
        kernels.compile_cubin(bad, "sm_80")
    assert "bad.cu" in str(e.value) and "undefined_name" in str(e.value)


def test_resources_names_every_kernel_with_its_registers():
    """ptxas's report, parsed: every kernel a source declares, with a register count in range,
    and a stack frame wherever it spills (its spill bytes count store instructions, which may
    reuse a slot: attention_prefill stores 48 bytes into a 32-byte frame on sm_90)."""
    for name, path in sorted(kernels.sources().items()):
        report = kernels.resources(path, "sm_90")
        assert set(report) == set(kernels.declared_kernels(path)), name
        for kernel, r in report.items():
            assert 0 < r["registers"] <= 255 and r["spill_stores"] >= 0 and r["spill_loads"] >= 0, (kernel, r)
            assert r["stack"] > 0 or r["spill_stores"] == r["spill_loads"] == 0, (kernel, r)


def test_resources_sees_local_memory(tmp_path):
    """A local array indexed at run time lives on the stack, a plain kernel has none: the parser
    reads each kernel's own line."""
    src = tmp_path / "local.cu"
    src.write_text('extern "C" __global__ void plain(float* x) { x[threadIdx.x] *= 2.f; }\n'
                   'extern "C" __global__ void local(float* x, int i) {\n'
                   '  float a[64] = {};\n'
                   '  for (int j = 0; j < 64; j++) a[(int)x[j * blockDim.x + threadIdx.x] & 63] += 1.f;\n'
                   '  x[threadIdx.x] = a[i & 63];\n'
                   '}\n')
    report = kernels.resources(src, "sm_80")
    assert report["plain"]["stack"] == 0 and report["local"]["stack"] >= 64 * 4, report


def test_and_or_lop3_table_is_its_c_fallback():
    """The one truth table in the kernels' inline PTX, which the CPU emulation never runs (it
    takes and_or's C branch): lop3.b32's immediate, applied bit by bit as PTX defines it (bit
    4a + 2b + c of the table for input bits a, b, c of its three operands), equals the fallback
    (a & MASK) | c on random words and masks."""
    src = (kernels.KERNEL_DIR / "common.cuh").read_text()
    body = src[src.index("and_or("):]
    asm = re.search(r'lop3\.b32 %0, %(\d), %(\d), %(\d), (0x[0-9A-Fa-f]+);"\s*:\s*"=r"\(r\)\s*:\s*(.+?)\);', body)
    assert asm, "and_or's lop3 not found in common.cuh"
    operands = [re.search(r"\((\w+)\)", o).group(1) for o in asm.group(5).split(",")]
    order = [operands[int(asm.group(i)) - 1] for i in (1, 2, 3)]  # %1.. are the inputs, in order
    table = int(asm.group(4), 16)
    rng = np.random.default_rng()
    seed = int(rng.integers(1 << 31))
    print("seed", seed)
    rng = np.random.default_rng(seed)
    for _ in range(64):
        values = {"a": int(rng.integers(1 << 32)), "MASK": int(rng.integers(1 << 32)), "c": int(rng.integers(1 << 32))}
        x, y, z = (values[name] for name in order)
        lop3 = sum(((table >> (4 * (x >> i & 1) + 2 * (y >> i & 1) + (z >> i & 1))) & 1) << i for i in range(32))
        assert lop3 == (values["a"] & values["MASK"]) | values["c"], (values, hex(table))
