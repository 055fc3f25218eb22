"""The GGUF → safetensors cache under faults (`hspec.models.gguf_cache`): two processes converting at once,
a kill during a cache write, a corrupted or unfinished cache. The conversion itself is a stand-in (a few
files and a pause) so that the tests take seconds; `dequantize_gguf` is what a real load runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from hspec.models.gguf_cache import MARKER_FILE, cache_problem, cached_conversion

SRC = Path(__file__).resolve().parents[1] / "src"

# A child process: converts argv[1] (a GGUF) into argv[2] with a stand-in that logs its pid to argv[3], writes
# half its weights, then dies by SIGKILL if argv[4] is "die", else pauses (so that a second process comes
# while it holds the lock) and finishes.
CHILD = """
import os, signal, sys, time
from pathlib import Path
from hspec.models.gguf_cache import cached_conversion

def convert(gguf, directory):
    with open(sys.argv[3], "a") as log:
        log.write(f"{os.getpid()}\\n")
    (directory / "model.safetensors").write_bytes(b"w" * 50_000)
    if sys.argv[4] == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(1.5)
    (directory / "model.safetensors").write_bytes(b"w" * 100_000)
    (directory / "config.json").write_text('{"model_type": "llama"}')

cached_conversion(Path(sys.argv[1]), Path(sys.argv[2]), convert)
"""


def _child(gguf: Path, out: Path, log: Path, mode: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, str(gguf), str(out), str(log), mode],
                            env={"PYTHONPATH": str(SRC)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _convert(gguf: Path, directory: Path) -> None:
    (directory / "model.safetensors").write_bytes(b"v" * 1000)
    (directory / "config.json").write_text('{"model_type": "llama"}')


def test_two_processes_converting_at_once_convert_once(tmp_path):
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    out, log = tmp_path / "cache" / "tiny", tmp_path / "conversions.log"
    children = [_child(gguf, out, log, "finish") for _ in range(2)]
    outputs = [child.communicate(timeout=120)[0] for child in children]
    assert [child.returncode for child in children] == [0, 0], outputs
    assert len(log.read_text().split()) == 1  # the second waited on the lock, then read the first's cache
    assert any("waiting for another process converting tiny.gguf" in text for text in outputs), outputs
    assert cache_problem(out) is None
    assert (out / "model.safetensors").read_bytes() == b"w" * 100_000
    assert sorted(p.name for p in out.parent.iterdir()) == [".tiny.lock", "tiny"]


def test_a_kill_during_a_cache_write_then_a_clean_load(tmp_path, capsys):
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    out, log = tmp_path / "cache" / "tiny", tmp_path / "conversions.log"
    killed = _child(gguf, out, log, "die")
    killed.communicate(timeout=120)
    assert killed.returncode == -9
    assert not out.exists()  # nothing was published: the half-written weights sit in a hidden temporary
    [staging] = out.parent.glob(".tiny.tmp-*")
    assert cached_conversion(gguf, out, _convert) == out
    printed = capsys.readouterr().out
    assert f"removed {staging}" in printed and "converting tiny.gguf to a safetensors cache" in printed
    assert cache_problem(out) is None and (out / "model.safetensors").read_bytes() == b"v" * 1000
    assert sorted(p.name for p in out.parent.iterdir()) == [".tiny.lock", "tiny"]


def test_a_corrupted_or_unfinished_cache_is_converted_again_with_a_message(tmp_path, capsys):
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    out = tmp_path / "cache" / "tiny"
    cached_conversion(gguf, out, _convert)
    capsys.readouterr()
    converted = []

    def convert(gguf: Path, directory: Path) -> None:
        converted.append(directory)
        _convert(gguf, directory)

    assert cached_conversion(gguf, out, convert) == out and not converted  # a sound cache is read as it is
    damages = {
        "model.safetensors differs from what was written": lambda: (out / "model.safetensors").write_bytes(
            b"v" * 999 + b"x"),
        "model.safetensors differs": lambda: (out / "model.safetensors").write_bytes(b"v" * 10),  # truncated
        f"no {MARKER_FILE}: its conversion never finished": lambda: (out / MARKER_FILE).unlink(),
        "its marker lists": lambda: (out / "tokenizer.json").write_text("{}"),  # a file no conversion wrote
        "is unreadable": lambda: (out / MARKER_FILE).write_text("{"),
    }
    for reason, damage in damages.items():
        damage()
        assert reason in cache_problem(out)
        cached_conversion(gguf, out, convert)
        printed = capsys.readouterr().out
        assert f"the cache at {out} is not usable (" in printed and reason in printed
        assert cache_problem(out) is None
    assert len(converted) == len(damages)
