"""Stopping a trainer cleanly on SIGINT (Ctrl-C) or SIGTERM.

While ``StopRequests`` is active, the first SIGINT or SIGTERM only records the request: the
training loop finishes the step in progress, writes a checkpoint (atomically, as always) and
returns. A second signal raises KeyboardInterrupt at once; whatever was being written then is
a temporary file or directory that is removed on the way out, so the previous checkpoint and
the ``latest`` pointer stay intact.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequests:
    """``with StopRequests() as stop: ... if stop.requested: ...``; a no-op off the main thread."""

    def __init__(self, on_first: Any = None) -> None:
        self.requested: str | None = None      # "SIGINT" / "SIGTERM" once one arrived
        self.signum: int | None = None
        self._on_first = on_first              # called with the signal name (e.g. to print)
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested is not None:
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}")
        self.requested = signal.Signals(signum).name
        self.signum = signum
        if self._on_first is not None:
            self._on_first(self.requested)

    def __enter__(self) -> "StopRequests":
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    @property
    def exit_code(self) -> int:
        """The shell's convention for a process stopped by a signal: 128 + its number."""
        return 128 + (self.signum or signal.SIGINT)
