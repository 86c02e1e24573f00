"""The error type for bad user input that the CLI reports without a traceback."""


def source_checkout():
    """The moeify source checkout this package runs from (the directory holding pyproject.toml
    and src/moeify), or None for an installed copy."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() and (root / "src" / "moeify").is_dir() \
        else None


def install_hint(extra: str | None = None, *, here: bool = True) -> str:
    """The command that installs moeify, with an optional extra, as the setup guide
    (docs/guide/setup.md) does: moeify is not on a package index, it is installed (editable) from
    its source checkout.
    ``here``: name this machine's checkout (not in files that travel, e.g. an export)."""
    spec = f".[{extra}]" if extra else "."
    root = source_checkout() if here else None
    return f"pip install -e '{spec}' in " + (f"the moeify checkout ({root})" if root
                                              else "a moeify source checkout")


class MoeifyError(Exception):
    """A problem the user can fix (bad config, missing file, corrupt checkpoint, ...).
    The message says what is wrong and what to do."""


_OS_ADVICE = {
    "ENOSPC": "the disk is full: free some space (or write somewhere else) and try again",
    "EDQUOT": "the disk quota is exhausted: free some space (or write somewhere else)",
    "EROFS": "the file system is read-only: choose a writable location",
    "EACCES": "permission denied: check its permissions or choose another location",
    "EPERM": "the operation is not permitted: check its permissions or choose another location",
    "EISDIR": "it is a directory: give a file path instead",
    "ENOTDIR": "a part of the path is a file, not a directory: check the path",
    "EEXIST": "it already exists and is in the way: choose another path or remove it",
    "ENOENT": "it does not exist: check the path",
    "ENAMETOOLONG": "the name is too long: choose a shorter path",
    "EMFILE": "too many open files: raise the limit (ulimit -n) and try again",
    "EIO": "an input/output error: the disk may be failing; check it and try again",
}


def describe_os_error(e: OSError) -> str:
    """One line for an operating-system error: the path, what went wrong, what to do."""
    import errno as _errno

    name = _errno.errorcode.get(e.errno or -1, "")
    what = _OS_ADVICE.get(name) or (e.strerror or str(e) or type(e).__name__).lower()
    paths = [p for p in (getattr(e, "filename", None), getattr(e, "filename2", None))
             if p is not None]
    where = " -> ".join(str(p) for p in paths)
    if not where:
        return str(e) if e.errno is None else f"{e.strerror or e} ({what})"
    return f"{where}: {what}"


def decode_error(path, e: UnicodeDecodeError) -> "MoeifyError":
    """The error for a file that is not UTF-8 text, naming the file and the offset."""
    return MoeifyError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); it may be "
                       "corrupt or binary: restore it or give the right file")


def read_utf8(path) -> str:
    """A file's text; a file that is not UTF-8 is a MoeifyError naming it."""
    from pathlib import Path

    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise decode_error(path, e) from None


def os_error_of(e: Exception, path) -> OSError | None:
    """The OSError inside a library's own error type (safetensors reports a full disk as
    ``SafetensorError(... (os error 28) ...)``), with ``path``; None when it carries none."""
    import os
    import re

    if isinstance(e, OSError):
        return e
    m = re.search(r"os error (\d+)", str(e))
    if m is None:
        return None
    code = int(m.group(1))
    return OSError(code, os.strerror(code), str(path))


_OFF = ("", "0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")


def env_flag(name: str, default: bool = False) -> bool:
    """Whether an on/off environment variable (MOEIFY_DEBUG, MOEIFY_NO_MALLOC_TUNING,
    MOEIFY_TRITON_PAD, ...) is on: ``default`` when unset; off for "", "0", "false", "no",
    "off"; on for "1", "true", "yes", "on" (any case). Any other value is a ValueError naming
    the variable: MOEIFY_TRITON_PAD=disable must not be read as on."""
    import os

    if name not in os.environ:
        return default
    value = os.environ[name].strip().lower()
    if value in _OFF:
        return False
    if value in _ON:
        return True
    raise ValueError(f"{name}={os.environ[name]!r} is not an on/off value: set it to 1 (or "
                     f"true, yes, on) or 0 (or false, no, off), or unset it")


def error_line(e: BaseException) -> str:
    """The one line the CLI prints for an error the user can act on (MOEIFY_DEBUG=1: traceback).
    OS errors name the path and what to do; other messages are joined onto one line."""
    if isinstance(e, OSError) and not isinstance(e, MoeifyError):
        text = describe_os_error(e)
    else:
        text = str(e)
    return " ".join(text.split()) or type(e).__name__
