"""Where a command's output goes: with `--json`, stdout carries the JSON and nothing else.

Libraries log to stdout: vLLM's logger writes there, its engine runs in child processes that inherit the
file descriptor, and a C++ build or hspec's own progress lines print there too. `json_stdout()` points
file descriptor 1 itself at stderr for as long as it is open, so every such write, from Python, C or a
child process, lands on stderr; the command writes its JSON to the stream it yields, the real stdout.
So `hspec bench vllm --json | jq` reads one JSON document.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO


@contextmanager
def json_stdout() -> Iterator[TextIO]:
    """Inside: fd 1 and `sys.stdout` write to stderr; the yielded stream writes to the real stdout.

    Restores both on exit, error or not. Not re-entrant: a nested call would yield stderr.
    """
    sys.stdout.flush()  # what was printed before goes out before fd 1 moves
    saved = os.dup(1)
    real = os.fdopen(saved, "w", closefd=False)
    python_stdout = sys.stdout
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        yield real
    finally:
        sys.stderr.flush()
        python_stdout.flush()  # a logger holding the old stream wrote to fd 1, i.e. stderr: let it out there
        real.flush()
        sys.stdout = python_stdout
        os.dup2(saved, 1)
        os.close(saved)
