"""The ``moeify`` command. Each subcommand lives in its own module under moeify.cli with a
``register(subparsers)`` function that adds its parser and sets ``func``."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from moeify.errors import env_flag, error_line
from moeify.runtime import MALLOC_ENV


def _reexec_with_malloc_tuning(argv: list[str] | None) -> None:
    """Restart the process once with MALLOC_ENV set (glibc reads them only at start-up)."""
    if argv is not None or env_flag("MOEIFY_NO_MALLOC_TUNING") or not sys.platform.startswith("linux"):
        return
    if all(os.environ.get(k) for k in MALLOC_ENV) or os.environ.get("_MOEIFY_REEXEC"):
        return
    try:
        import platform

        if platform.libc_ver()[0] != "glibc":
            return
    except Exception:
        return
    env = {**os.environ, **MALLOC_ENV, "_MOEIFY_REEXEC": "1"}
    try:
        os.execve(sys.executable, [sys.executable, "-m", "moeify.cli.main", *sys.argv[1:]], env)
    except OSError:
        return


# Subcommand modules, in the order --help lists them.
COMMANDS = ["demo", "bench", "presets", "count", "match", "train", "upcycle", "eval", "generate",
            "plot", "compare", "sweep", "import", "export"]
# Subcommands whose module cannot carry their name (``import`` is a Python keyword).
MODULES = {"import": "import_"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moeify",
        description="Mixture-of-Experts everywhere inside a Transformer: build, train, evaluate, "
        "benchmark and inspect SwitchHead, MoA, sigma-MoE, Switch, Mixture-of-Depths, MoEUT and MoSA "
        "models.",
    )
    from moeify import __version__

    parser.add_argument("--version", action="version", version=f"moeify {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(f"moeify.cli.{MODULES.get(name, name)}").register(sub)
    show_defaults(parser)
    return parser


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Append "(default: X)" to the help of every option, in every subcommand, that has a
    default its help does not already state (None, False and empty lists are no defaults)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                show_defaults(sub)
            continue
        default = action.default
        if (not action.option_strings or action.help in (None, argparse.SUPPRESS)
                or default is None or default is False or default == []
                or default is argparse.SUPPRESS or "default" in action.help):
            continue
        shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else default
        action.help += f" (default: {str(shown).replace('%', '%%')})"


def _closed_pipe() -> int:
    """The reader of stdout went away (``moeify presets | head -1``): end quietly. stdout is
    pointed at /dev/null so that the interpreter's last flush does not complain; the status is
    the shell's for a process ended by SIGPIPE."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return 141


def _quiet_exit(code: int) -> None:
    """The command has finished (its outputs are complete, stdout flushed): a Ctrl-C or SIGTERM
    that arrives while the interpreter exits (two Ctrl-Cs 50 ms apart during a checkpoint
    write) ends the process at once with the command's own status, instead of interrupting
    an atexit handler (torch registers some) with a KeyboardInterrupt traceback."""
    import signal

    def leave(signum, frame):
        os._exit(code)

    for s in (signal.SIGINT, signal.SIGTERM):
        try:
            signal.signal(s, leave)
        except (ValueError, OSError):  # not the main thread
            pass


def main(argv: list[str] | None = None) -> int:
    try:  # the switches read before and while handling errors: a bad value is one line too
        env_flag("MOEIFY_DEBUG")
        env_flag("MOEIFY_NO_MALLOC_TUNING")
    except ValueError as e:
        print(f"moeify: error: {e}", file=sys.stderr)
        return 2
    code = _main(argv)
    if argv is None:  # the process itself, not a caller in Python
        _quiet_exit(code)
    return code


def _main(argv: list[str] | None) -> int:
    _reexec_with_malloc_tuning(argv)
    args = build_parser().parse_args(argv)
    from moeify.errors import MoeifyError

    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here when the output fitted in its buffer
        return code
    except BrokenPipeError:
        return _closed_pipe()
    except (MoeifyError, ValueError, OSError) as e:
        if env_flag("MOEIFY_DEBUG"):
            raise
        print(f"moeify {args.command}: error: {error_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"moeify {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
