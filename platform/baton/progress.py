"""A progress line: step/total, loss, tokens/s, elapsed and ETA. Redrawn in place on a
terminal; on a pipe or a log, a plain line every `every_s` seconds and at the end."""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

from baton.storage import redact


def _clock(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}" if h else f"{rem // 60:02d}:{rem % 60:02d}"


class Progress:
    def __init__(self, total: int, start: int = 0, stream: Optional[TextIO] = None,
                 enabled: bool = True, every_s: float = 10.0, unit: str = "tok"):
        self.total, self.start_step, self.unit = total, start, unit
        self.stream, self.enabled, self.every_s = stream or sys.stderr, enabled, every_s
        self.tty = enabled and self.stream.isatty()
        self.t0 = time.monotonic()
        self._last = 0.0

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        elapsed = now - self.t0
        done = step - self.start_step
        eta = elapsed / done * (self.total - step) if done else 0.0
        width = 24
        filled = int(width * step / self.total)
        line = (f"[{'#' * filled}{'.' * (width - filled)}] step {step}/{self.total} "
                f"loss {loss:.4f} | {tokens_per_s:,.0f} {self.unit}/s | {_clock(elapsed)} < {_clock(eta)}")
        if self.tty:
            self.stream.write("\r" + line + ("\n" if step == self.total else ""))
            self.stream.flush()
        elif step == self.total or now - self._last >= self.every_s or done == 1:
            self.stream.write(line + "\n")
            self.stream.flush()
            self._last = now

    def note(self, text: str) -> None:
        """A line about an event (a failure, a recovery, a resize), between progress lines."""
        if self.enabled:
            self.stream.write(("\n" if self.tty else "") + redact(text) + "\n")
            self.stream.flush()
