"""A training run stopped by SIGTERM or SIGINT (Ctrl-C, a session's end, a scheduler's preemption) keeps
its work: the signal is only noted, the run finishes its current step, saves its resumable state and
exits, so rerunning the same command continues from that step instead of the last periodic save.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """While entered (in the main thread), SIGTERM/SIGINT set `signal_number` instead of ending the process.

    A second signal of the same kind while a stop is pending ends the process as usual, so a run stuck
    in a long step can still be killed."""

    def __init__(self) -> None:
        self.signal_number: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signal_number is not None

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._note) for s in STOP_SIGNALS}
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)  # type: ignore[arg-type]
        self._previous = {}

    def _note(self, number: int, frame: FrameType | None) -> None:
        if self.signal_number is not None:
            signal.signal(number, self._previous.get(number, signal.SIG_DFL))  # type: ignore[arg-type]
            signal.raise_signal(number)
        self.signal_number = number
