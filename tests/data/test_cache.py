"""The cache: location, atomic writes, checksums, downloads and PyPI members (no network)."""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import zipfile
from pathlib import Path

import pytest

from moeify.data import cache
from moeify.errors import MoeifyError


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEIFY_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_cache_dir_follows_environment(tmp_path, monkeypatch):
    assert cache.cache_dir() == tmp_path / "cache"
    monkeypatch.delenv("MOEIFY_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_dir() == tmp_path / "xdg" / "moeify"
    assert (tmp_path / "xdg" / "moeify").is_dir()


def test_atomic_write_keeps_old_content_on_failure(tmp_path):
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with cache.atomic_write(target) as f:
            f.write(b"partial new content")
            raise RuntimeError("killed mid-write")
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]  # no temp file left
    with cache.atomic_write(target) as f:
        f.write(b"new")
    assert target.read_bytes() == b"new"


def test_verify_checksum_algorithms(tmp_path):
    p = tmp_path / "x"
    p.write_bytes(b"abc")
    cache.verify_checksum(p, hashlib.sha256(b"abc").hexdigest())
    cache.verify_checksum(p, "sha1:" + hashlib.sha1(b"abc").hexdigest())
    with pytest.raises(MoeifyError, match="checksum mismatch.*delete it"):
        cache.verify_checksum(p, "sha256:" + "0" * 64)
    with pytest.raises(ValueError, match="unknown checksum algorithm"):
        cache.verify_checksum(p, "crc32:abcd")


def test_download_file_url_verifies_and_reuses(tmp_path, monkeypatch):
    src = tmp_path / "payload.bin"
    src.write_bytes(os.urandom(3000))
    digest = hashlib.sha256(src.read_bytes()).hexdigest()
    dest = tmp_path / "dl" / "payload.bin"
    out = cache.download(src.as_uri(), dest, expected=digest, size=3000)
    assert out.read_bytes() == src.read_bytes()

    def no_network(url):
        raise AssertionError("a verified cached file must not be fetched again")

    monkeypatch.setattr(cache, "_open_url", no_network)
    assert cache.download(src.as_uri(), dest, expected=digest) == dest


def test_download_rejects_bad_checksum_and_size(tmp_path):
    src = tmp_path / "payload.bin"
    src.write_bytes(b"x" * 100)
    dest = tmp_path / "dl.bin"
    with pytest.raises(MoeifyError, match="checksum mismatch"):
        cache.download(src.as_uri(), dest, expected="0" * 64)
    assert not dest.exists()
    with pytest.raises(MoeifyError, match="has 100 bytes, expected 99"):
        cache.download(src.as_uri(), dest, size=99)
    assert not dest.exists()


def test_download_unreachable_says_what_to_do(tmp_path):
    with pytest.raises(MoeifyError, match="(?s)offline.*place it at"):
        cache.download((tmp_path / "missing.zip").as_uri(), tmp_path / "out.zip")


def _fake_wheel(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return buf.getvalue()


def test_pypi_file_extracts_and_verifies_a_member(monkeypatch):
    wheel = _fake_wheel({"pkg/data/a.txt": b"alpha", "pkg/data/b.txt": b"beta", "pkg/x.py": b""})
    calls = []

    def fake_pip(requirement, dest, pip_args):
        calls.append((requirement, pip_args))
        (dest / "pkg-1.0-py3-none-any.whl").write_bytes(wheel)

    monkeypatch.setattr(cache, "_pip_download", fake_pip)
    sha_b = hashlib.sha256(b"beta").hexdigest()
    path = cache.pypi_file("pkg==1.0", "pkg/data/b.txt", expected=sha_b,
                           pip_args=("--only-binary=:all:",))
    assert path.read_bytes() == b"beta"
    # The archive is downloaded once; further members come from the cached distribution.
    assert cache.pypi_file("pkg==1.0", "pkg/data/a.txt",
                           pip_args=("--only-binary=:all:",)).read_bytes() == b"alpha"
    assert calls == [("pkg==1.0", ["--only-binary=:all:"])]
    with pytest.raises(MoeifyError, match="checksum mismatch"):
        cache.pypi_file("pkg==1.0", "pkg/x.py", expected="0" * 64,
                        pip_args=("--only-binary=:all:",))
    with pytest.raises(MoeifyError, match="holds 2 members"):
        cache.pypi_file("pkg==1.0", "pkg/data/*.txt", pip_args=("--only-binary=:all:",))


def test_pip_failure_is_a_clear_error(monkeypatch):
    def failing_run(cmd, **kw):
        assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"]
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(subprocess, "run", failing_run)
    with pytest.raises(MoeifyError, match="(?s)No matching distribution.*PyPI is reachable"):
        cache.pypi_archive("nonexistent-package==9.9")


def test_archive_members_reads_tarballs(tmp_path):
    import tarfile

    src = tmp_path / "a.tar.gz"
    with tarfile.open(src, "w:gz") as t:
        for name, data in {"p-1/d/x_gut.txt": b"x", "p-1/d/y.txt": b"y"}.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    assert cache.archive_members(src, "*/d/*_gut.txt") == {"p-1/d/x_gut.txt": b"x"}
    bad = tmp_path / "bad.tar.gz"
    bad.write_bytes(b"not an archive")
    with pytest.raises(MoeifyError, match="cannot read archive"):
        cache.archive_members(bad, "*")


def test_slug_is_filesystem_safe():
    s = cache._slug("pkg==1.0 --platform x/y")
    assert "/" not in s and " " not in s and Path(s).name == s
