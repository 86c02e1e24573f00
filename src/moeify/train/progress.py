"""A one-line progress display on stderr: step, loss, bpc/ppl, lr, tokens/s and ETA.

On a terminal the line is redrawn in place; otherwise (a log file, CI) a new line is printed at
most every ``min_interval_s`` seconds, so logs stay short.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


def format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def format_rate(tokens_per_s: float) -> str:
    if tokens_per_s >= 1e6:
        return f"{tokens_per_s / 1e6:.2f}M"
    if tokens_per_s >= 1e3:
        return f"{tokens_per_s / 1e3:.1f}k"
    return f"{tokens_per_s:.0f}"


class Progress:
    """Tracks throughput since ``start_step`` and prints ``update`` lines."""

    def __init__(self, total_steps: int, start_step: int = 0, *, stream: TextIO | None = None,
                 enabled: bool = True, min_interval_s: float = 10.0) -> None:
        self.total = total_steps
        self.start_step = start_step
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.min_interval_s = 0.0 if self.tty else min_interval_s
        self.t0 = time.perf_counter()
        self._last_print = -float("inf")
        self._open_line = False

    def restart(self, step: int) -> None:
        """Count the rate (hence the ETA) from ``step`` on, e.g. after compilation."""
        self.t0 = time.perf_counter()
        self.start_step = step

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def eta(self, step: int) -> float:
        done = step - self.start_step
        if done <= 0:
            return float("nan")
        return self.elapsed() / done * (self.total - step)

    def line(self, step: int, values: dict[str, float], tokens_per_s: float) -> str:
        parts = [f"step {step}/{self.total}"]
        for key, v in values.items():
            parts.append(f"{key} {v:.3g}" if key == "lr" else f"{key} {v:.4f}")
        eta = self.eta(step)
        parts.append(f"{format_rate(tokens_per_s)} tok/s")
        parts.append(f"ETA {format_duration(eta) if eta == eta else '?'}")
        return " | ".join(parts)

    def update(self, step: int, values: dict[str, float], tokens_per_s: float,
               force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self._last_print < self.min_interval_s:
            return
        self._last_print = now
        text = self.line(step, values, tokens_per_s)
        if self.tty:
            self.stream.write("\r\033[K" + text)
            self._open_line = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        """Print a full line (e.g. a validation result) without breaking the progress line."""
        if not self.enabled:
            return
        if self._open_line:
            self.stream.write("\r\033[K")
            self._open_line = False
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self._open_line:
            self.stream.write("\n")
            self.stream.flush()
            self._open_line = False


class CountProgress:
    """``LABEL: done/total UNIT (pct), elapsed, ETA`` for work counted in items (evaluation
    items, harness requests), as a ``progress(done, total)`` callback. Redrawn in place on a
    terminal; otherwise a line at most every ``min_interval_s`` seconds, and the last one."""

    def __init__(self, label: str, unit: str, *, stream: TextIO | None = None,
                 enabled: bool = True, min_interval_s: float = 10.0) -> None:
        self.label, self.unit = label, unit
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.min_interval_s = 0.2 if self.tty else min_interval_s
        self.t0 = time.perf_counter()
        self._last = -float("inf")
        self._open_line = False

    def line(self, done: int, total: int) -> str:
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / done * (total - done) if done else float("nan")
        pct = 100.0 * done / total if total else 100.0
        return (f"{self.label}: {done:,}/{total:,} {self.unit} ({pct:.0f}%), "
                f"{format_duration(elapsed)} elapsed, ETA "
                f"{format_duration(eta) if eta == eta else '?'}")

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if done < total and now - self._last < self.min_interval_s:
            return
        self._last = now
        if self.tty:
            self.stream.write("\r\033[K" + self.line(done, total))
            self._open_line = done < total
            if not self._open_line:
                self.stream.write("\n")
        else:
            self.stream.write(self.line(done, total) + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._open_line:
            self.stream.write("\n")
            self.stream.flush()
            self._open_line = False
