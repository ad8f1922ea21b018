"""A kernel build killed mid-way (SIGKILL, OOM) leaves torch's build lock file behind; the next
build must not wait on it forever (it did: every worker restart of a chaos run hung there)."""

from __future__ import annotations

import os

import pytest
from torch.utils import cpp_extension
from torch.utils.file_baton import FileBaton

from kvrelay.kernels import cpu_build


def _torch_like_load(calls: list[str]):
    """cpp_extension.load's locking, with the compiler left out: the baton's holder builds,
    anyone else waits until the baton's file is gone."""

    def load(name, sources, extra_cflags, extra_ldflags, build_directory, verbose):
        baton = FileBaton(os.path.join(build_directory, "lock"))
        if baton.try_acquire():
            try:
                calls.append(name)
            finally:
                baton.release()
        else:
            baton.wait()
        return f"module {name}"

    return load


@pytest.mark.timeout(60)  # the bug this guards against is a hang
def test_a_lock_left_by_a_killed_build_does_not_block_the_next(tmp_path, monkeypatch):
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path))
    calls: list[str] = []
    monkeypatch.setattr(cpp_extension, "load", _torch_like_load(calls))
    name, build_dir, _ = cpu_build._paths("avx2")
    build_dir.mkdir(parents=True)
    (build_dir / "lock").touch()  # what a builder SIGKILLed inside cpp_extension.load leaves

    assert cpu_build.build(variant="avx2") == f"module {name}"
    assert calls == [name]  # this build took the baton and ran, once
    assert sorted(p.name for p in build_dir.iterdir()) == ["build.flock", "built"]
