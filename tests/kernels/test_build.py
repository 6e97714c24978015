"""The kernels' build: each failure path says which step failed, and the cache is shared
safely (a lock, the compiler in the key, a fallback directory, a rebuild of a damaged file)."""

from __future__ import annotations

import ctypes
import os
import shutil
import stat
import threading
from pathlib import Path

import pytest

from vlite.kernels import build, native

TINY_SOURCE = "int vl_answer(void) { return 42; }\n"
needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler here")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache directory, and a fallback directory of the test's own."""
    directory = tmp_path / "cache"
    monkeypatch.setenv("VLITE_CACHE_DIR", str(directory))
    monkeypatch.setattr(build, "fallback_cache_dir", lambda: tmp_path / "fallback")
    build._warn_fallback.cache_clear()
    return directory / "kernels"


@pytest.fixture
def tiny(tmp_path):
    source = tmp_path / "src" / "tiny.c"
    source.parent.mkdir()
    source.write_text(TINY_SOURCE)
    return source


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _answer(path: Path) -> int:
    return ctypes.CDLL(str(path)).vl_answer()


@needs_cc
def test_a_library_is_built_once_then_found_in_the_cache(cache, tiny):
    path = build.build_library(tiny)
    assert path.parent == cache and _answer(path) == 42
    modified = path.stat().st_mtime_ns
    assert build.build_library(tiny) == path and path.stat().st_mtime_ns == modified


def test_no_compiler_is_named(monkeypatch, tmp_path):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # holds no cc or gcc
    with pytest.raises(native.NativeKernelsUnavailable, match="no C compiler found"):
        build.compiler()


def test_a_compiler_that_cannot_run_is_named(monkeypatch, cache, tiny):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.raises(native.NativeKernelsUnavailable, match="/nonexistent/cc could not run"):
        build.build_library(tiny)


@needs_cc
def test_a_compile_error_names_the_source_and_the_compiler_s_error(cache, tmp_path):
    broken = tmp_path / "broken.c"
    broken.write_text("int vl_answer(void) { return 42 }\n")
    with pytest.raises(native.NativeKernelsUnavailable) as failure:
        build.build_library(broken)
    message = str(failure.value)
    assert "compiling broken.c with" in message and "error" in message
    assert not list(cache.glob("*.so")), "a failed compile left a library behind"


@needs_cc
def test_an_unwritable_cache_builds_in_the_fallback_and_says_so(
    cache, tiny, tmp_path, monkeypatch, capsys
):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("VLITE_CACHE_DIR", str(blocker / "x"))  # under a file: not creatable
    path = build.build_library(tiny)
    assert path.parent == tmp_path / "fallback" and _answer(path) == 42
    err = capsys.readouterr().err
    assert f"{blocker / 'x' / 'kernels'} cannot be written" in err
    assert str(tmp_path / "fallback") in err


def test_no_writable_directory_at_all_is_named(tmp_path, monkeypatch, tiny):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("VLITE_CACHE_DIR", str(blocker / "x"))
    monkeypatch.setattr(build, "fallback_cache_dir", lambda: blocker / "y")
    with pytest.raises(native.NativeKernelsUnavailable, match="nor .*a-file/y"):
        build.writable_cache_dir()


@needs_cc
def test_the_compiler_is_part_of_the_key(cache, tiny, tmp_path, monkeypatch):
    default = build.build_library(tiny)
    wrapper = _script(tmp_path / "my-cc", f'exec {shutil.which("cc")} "$@"\n')
    monkeypatch.setenv("CC", str(wrapper))
    other = build.build_library(tiny)
    assert other != default and _answer(other) == 42


@needs_cc
def test_concurrent_builders_compile_once(cache, tiny, tmp_path, monkeypatch):
    """Tensor-parallel workers on a cold cache: one compiles, the others wait for it."""
    log = tmp_path / "compiles.log"
    counting = _script(
        tmp_path / "counting-cc",
        f'case "$*" in *" -o "*) echo compile >> {log}; sleep 0.3;; esac\n'
        f'exec {shutil.which("cc")} "$@"\n',
    )
    monkeypatch.setenv("CC", str(counting))
    paths, errors = [], []

    def builder() -> None:
        try:
            paths.append(build.build_library(tiny))
        except Exception as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=builder) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(set(paths)) == 1 and _answer(paths[0]) == 42
    assert log.read_text().splitlines() == ["compile"]


@needs_cc
def test_a_damaged_cached_library_is_built_again(cache, tiny, monkeypatch):
    path = build.build_library(tiny)
    path.write_bytes(b"not a shared object")
    monkeypatch.setitem(native._LIBRARIES, "tiny", (tiny, ctypes.CDLL))
    loaded = native._load.__wrapped__("tiny")
    assert loaded.vl_answer() == 42
    assert os.path.getsize(path) > len(b"not a shared object")


def test_the_model_says_when_the_fused_ops_are_off(monkeypatch, capsys):
    from vlite.models import llama

    def refuse():
        raise native.NativeKernelsUnavailable("compiling fused_ops.c failed: no room")

    monkeypatch.setattr(llama, "fused_ops", refuse)

    class Model:
        native_ops = None

        def use_fused_ops(self, ops):
            self.native_ops = ops

    model = Model()
    llama.LlamaForCausalLM.use_native_ops(model)
    assert model.native_ops is None
    assert "fused ops: off (compiling fused_ops.c failed: no room)" in capsys.readouterr().err
