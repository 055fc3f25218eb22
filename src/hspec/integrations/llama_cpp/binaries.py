"""llama.cpp's own binaries, driven as processes: find them, run greedy completions, read their counters.

scripts/build_llama_cpp.sh builds `llama-cli`, `llama-server` and `llama-bench` into
`$HSPEC_CACHE/llama.cpp/<version>/src/build/bin` (default ~/.cache/hspec); `$HSPEC_LLAMA_CPP_BIN` names
another folder. A completion goes through `llama-server` rather than `llama-cli` (the same
`common/speculative.cpp` drafting): its `/completion` answer carries the generated token ids, which the
equality check compares, and llama.cpp's own timings (`prompt_ms`, `predicted_ms`) and draft counters
(`draft_n`, `draft_n_accepted`), from which decode and prefill speed and tau are read without any Python
clock around them.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from hspec.models.loading import cache_root

BINARIES = ("llama-cli", "llama-server", "llama-bench")
BIN_ENV = "HSPEC_LLAMA_CPP_BIN"


def find_bin_dir() -> Path | None:
    """The folder holding the three binaries: $HSPEC_LLAMA_CPP_BIN, else the newest build under
    `cache_root()/llama.cpp/`; None when neither has them (scripts/build_llama_cpp.sh builds them)."""
    candidates = []
    if os.environ.get(BIN_ENV):
        candidates.append(Path(os.environ[BIN_ENV]).expanduser())
    candidates += sorted((cache_root() / "llama.cpp").glob("*/src/build/bin"), reverse=True)
    for folder in candidates:
        if all(os.access(folder / name, os.X_OK) for name in BINARIES):
            return folder
    return None


def build_id(bin_dir: Path) -> str:
    """llama.cpp's own version line, e.g. 'version: 1 (0c1e570) built with GNU 12.2.0 for Linux x86_64'."""
    out = subprocess.run([str(bin_dir / "llama-server"), "--version"], capture_output=True, text=True, timeout=60)
    return " ".join(line.strip() for line in (out.stdout + out.stderr).splitlines() if line.strip())


@dataclass(frozen=True)
class Completion:
    """One greedy `/completion` of llama-server, with llama.cpp's own timings and draft counters."""

    tokens: list[int]  # the generated ids (the first comes from the prefill's logits)
    prompt_n: int  # prompt tokens evaluated
    prompt_ms: float  # their prefill time
    predicted_n: int  # tokens generated
    predicted_ms: float  # from the first generated token to the last: predicted_n - 1 decode steps
    draft_n: int  # tokens drafted (0 without speculation)
    draft_accepted: int  # of which the target accepted

    @property
    def decode_tok_s(self) -> float:
        """Tokens/s after the first (which the prefill's logits give), as llama.cpp's `predicted_per_second`."""
        return 1000 * (self.predicted_n - 1) / self.predicted_ms if self.predicted_ms > 0 else float("nan")

    @property
    def prefill_tok_s(self) -> float:
        return 1000 * self.prompt_n / self.prompt_ms if self.prompt_ms > 0 else float("nan")

    @property
    def target_steps(self) -> int:
        """Target forwards after the prefill: each commits exactly one token the drafts did not propose (the
        correction or the bonus), so steps = (predicted_n - 1) - accepted; the prefill gave the first token."""
        return max(1, self.predicted_n - 1 - self.draft_accepted)

    @property
    def tau(self) -> float:
        """Mean tokens committed per target forward, from llama.cpp's counters: (predicted_n - 1) / steps."""
        return (self.predicted_n - 1) / self.target_steps


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    """A `llama-server` process on a free local port, one slot, for greedy completions (a context manager).

    args: extra llama.cpp arguments, e.g. `["-md", draft, "--spec-type", "draft-dspark"]`. The log goes to
    `log_path` (default: discarded), which a failed start quotes.
    """

    def __init__(self, bin_dir: Path, model: str | Path, args: Sequence[str] = (), threads: int = 2,
                 ctx_size: int = 4096, log_path: Path | None = None, start_timeout_s: float = 300) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [str(bin_dir / "llama-server"), "-m", str(model), "--host", "127.0.0.1", "--port",
                        str(self.port), "-t", str(threads), "-tb", str(threads), "-c", str(ctx_size), "-np", "1",
                        "--no-webui", *args]
        self.log_path = log_path
        self.start_timeout_s = start_timeout_s
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> LlamaServer:
        log = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL  # noqa: SIM115 (closed by the child's end)
        self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited with status {self.process.returncode} while starting: "
                                   f"{' '.join(self.command)}{self._log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as answer:
                    if answer.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        self.__exit__(None, None, None)
        raise RuntimeError(f"llama-server did not answer /health within {self.start_timeout_s:.0f} s{self._log_tail()}")

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def _log_tail(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        lines = self.log_path.read_text(errors="replace").splitlines()[-25:]
        return "\n--- llama-server log (tail) ---\n" + "\n".join(lines)

    def complete(self, prompt_ids: Sequence[int], n_predict: int, ignore_eos: bool = True) -> Completion:
        """Greedy decoding of `n_predict` tokens after the token ids `prompt_ids` (no prompt cache reuse, so
        every call prefills the whole prompt)."""
        body = {"prompt": [int(t) for t in prompt_ids], "n_predict": n_predict, "temperature": 0.0, "top_k": 1,
                "seed": 0, "cache_prompt": False, "return_tokens": True, "ignore_eos": ignore_eos, "stream": False}
        request = urllib.request.Request(self.url + "/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=1800) as answer:
            reply = json.loads(answer.read())
        t = reply["timings"]
        return Completion(tokens=[int(x) for x in reply.get("tokens", [])], prompt_n=int(t["prompt_n"]),
                          prompt_ms=float(t["prompt_ms"]), predicted_n=int(t["predicted_n"]),
                          predicted_ms=float(t["predicted_ms"]), draft_n=int(t.get("draft_n", 0)),
                          draft_accepted=int(t.get("draft_n_accepted", 0)))


def llama_bench(bin_dir: Path, model: str | Path, threads: int, prompt_tokens: Sequence[int],
                gen_tokens: int, depths: Sequence[int], repetitions: int = 3) -> list[dict]:
    """`llama-bench -o json` rows: pp<P> (prefill of P tokens) and tg<N> @ d<depth> (decode after a context of
    `depth` tokens), each with llama.cpp's mean and stddev tokens/s (`avg_ts`, `stddev_ts`)."""
    command = [str(bin_dir / "llama-bench"), "-m", str(model), "-t", str(threads), "-o", "json",
               "-r", str(repetitions), "-p", ",".join(map(str, prompt_tokens)) or "0", "-n", "0"]
    rows = json.loads(subprocess.run(command, capture_output=True, text=True, check=True, timeout=3600).stdout)
    command = [str(bin_dir / "llama-bench"), "-m", str(model), "-t", str(threads), "-o", "json",
               "-r", str(repetitions), "-p", "0", "-n", str(gen_tokens), "-d", ",".join(map(str, depths))]
    rows += json.loads(subprocess.run(command, capture_output=True, text=True, check=True, timeout=3600).stdout)
    return rows
