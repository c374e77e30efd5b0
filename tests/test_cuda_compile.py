"""Every CUDA source compiles with NVRTC, through ptxas, for every supported architecture, and
every kernel it declares is in the machine code: no GPU needed (ARCHITECTURE 7)."""

from __future__ import annotations

import pytest

from nerva_cli import kernels


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
    """ptxas's report, parsed: every kernel a source declares, with a register count in range."""
    for name, path in sorted(kernels.sources().items()):
        report = kernels.resources(path, "sm_90")
        assert set(report) == set(kernels.declared_kernels(path)), name
        for kernel, r in report.items():
            assert 0 < r["registers"] <= 255 and r["stack"] >= r["spill_stores"] >= 0, (kernel, r)


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
