"""Building the native CPU kernels degrades to the torch path instead of failing."""

from __future__ import annotations

import logging

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
