"""Building the native CPU kernels degrades to the torch path instead of failing."""

from __future__ import annotations

import logging
import os
import platform
import time
from pathlib import Path

import pytest

from pdserve.model.kernels import build
from pdserve.model.kernels.cpu_ops import SOURCE


def test_missing_compiler_gives_none_and_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING):
        assert build.load_library(SOURCE) is None
    assert "compiling cpu_ops.c for portable failed" in caplog.text
    assert not list((tmp_path / "cache").rglob("*.so*"))  # no partial library left behind


def test_broken_source_gives_none(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    source = tmp_path / "broken.c"
    source.write_text("this is not C;")
    assert build.load_library(source) is None


def test_each_edit_of_a_source_replaces_its_least_recently_used_build(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    source = tmp_path / "tiny.c"
    loaded = []
    for version in range(build.NUM_KEPT_BUILDS + 2):
        source.write_text(f"int version(void) {{ return {version}; }}\n")
        library = build.load_library(source)
        assert library is not None and library.version() == version
        loaded.append(Path(library._name))
    cached = set(build.cache_dir().glob("tiny-portable-*.so"))
    assert cached == set(loaded[-build.NUM_KEPT_BUILDS :])


def test_using_an_old_build_keeps_it_and_other_variants_are_left_alone(tmp_path):
    def cached(name: str, age_s: float) -> Path:
        path = tmp_path / name
        path.write_bytes(b"")
        os.utime(path, (time.time() - age_s,) * 2)
        return path

    builds = [cached(f"cpu_ops-avx2-{i:016x}.so", age_s=100 * i) for i in range(6)]
    other_variant = cached(f"cpu_ops-avx512-{0:016x}.so", age_s=10_000)
    unrelated = cached("cpu_ops-avx2-notakey.so", age_s=10_000)
    oldest = builds[-1]
    assert build.mark_used(oldest)
    build.prune_older(oldest, num_kept=3)
    assert set(tmp_path.iterdir()) == {oldest, *builds[:2], other_variant, unrelated}
    assert not build.mark_used(builds[3])  # removed: the next load compiles it again


@pytest.mark.parametrize("isa", build.VARIANTS, ids=lambda isa: isa.name)
def test_every_variant_compiles_even_where_this_cpu_cannot_run_it(tmp_path, isa):
    """The kernels' source builds for every ISA variant of this machine's architecture, those
    its CPU lacks too (an AMX-only section that breaks shows here on a Zen machine, not first
    on a Sapphire Rapids one); the variants it runs are built and run by the kernel tests."""
    if build.can_run(isa):
        pytest.skip("this CPU runs it: built and tested by the kernel tests")
    if isa.machines is not None and platform.machine().lower() not in isa.machines:
        pytest.skip(f"{isa.name} is not for {platform.machine()}")
    compiler = build.find_compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    assert build._compile(compiler, SOURCE, isa, tmp_path / f"{isa.name}.so")
