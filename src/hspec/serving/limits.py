"""What the server refuses and how long it waits: access, backpressure, deadlines, connections, drain.

One frozen dataclass that `create_app` (access, backpressure, deadlines, engine failure) and the HTTP
server (connections, timeouts, drain: server.py, connections.py) both read, so a test builds the same
server `hspec serve` runs. Every field's flag is named in its error.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")  # the Host header values a loopback server accepts


@dataclass(frozen=True)
class ServingLimits:
    """Guards of one server; the defaults are what `hspec serve` uses."""

    api_key: str | None = None  # clients must send `Authorization: Bearer <key>` on /v1/*; None: open
    allowed_hosts: tuple[str, ...] | None = None  # Host header names accepted (any port); None: any
    max_waiting: int | None = None  # queued requests beyond this get 503 + Retry-After; None: no bound
    retry_after_s: int = 1  # the Retry-After of those 503s
    request_timeout_s: float | None = None  # queue + run deadline of a request; None: none
    max_failed_steps: int = 3  # this many engine steps failing in a row mark the engine broken
    max_connections: int = 1024  # open TCP connections; the server closes more at once
    header_timeout_s: float = 10.0  # a connection with no complete request head after this is closed; a body: 408
    keep_alive_s: int = 5  # an idle keep-alive connection is closed after this
    drain_timeout_s: float = 30.0  # on shutdown, requests in flight get this long before they are failed

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key must not be empty (leave it out for an open server)")
        if self.max_waiting is not None and self.max_waiting < 0:
            raise ValueError(f"--max-waiting must be >= 0 (0: no request waits), got {self.max_waiting}")
        if self.retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {self.retry_after_s}")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:  # also refuses NaN
            raise ValueError(f"--request-timeout must be > 0 seconds, got {self.request_timeout_s}")
        if self.max_failed_steps < 1:
            raise ValueError(f"--max-failed-steps must be >= 1, got {self.max_failed_steps}")
        if self.max_connections < 1:
            raise ValueError(f"--max-connections must be >= 1, got {self.max_connections}")
        if not self.header_timeout_s > 0:
            raise ValueError(f"--header-timeout must be > 0 seconds, got {self.header_timeout_s}")
        if self.keep_alive_s < 1:
            raise ValueError(f"--keep-alive-timeout must be >= 1 second, got {self.keep_alive_s}")
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"--drain-timeout must be >= 0 seconds, got {self.drain_timeout_s}")


def is_loopback(host: str) -> bool:
    """Whether binding `host` serves this machine only (127.0.0.0/8, ::1 or `localhost`)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a name other than localhost: it may resolve anywhere
        return False


def host_name(header: str) -> str:
    """The name of a Host header without its port: `127.0.0.1:8000` -> `127.0.0.1`, `[::1]:80` -> `::1`."""
    header = header.strip().lower()
    if header.startswith("["):  # an IPv6 literal, its port after the bracket
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header
