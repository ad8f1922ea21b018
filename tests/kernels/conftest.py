"""Fixtures shared by the kernel tests."""

from __future__ import annotations

import pytest

from kvrelay.kernels import cpu_build


@pytest.fixture(params=tuple(cpu_build.VARIANTS))
def isa(request):
    """Each ISA variant of the C++ kernels in turn, used by every public op in the test."""
    variant = request.param
    if variant not in cpu_build.supported_variants():
        needs = ", ".join(sorted(cpu_build.VARIANT_CPU_FLAGS[variant]))
        pytest.skip(f"this CPU cannot run the {variant} kernels (they need {needs})")
    with cpu_build.use_variant(variant):
        yield variant
