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
