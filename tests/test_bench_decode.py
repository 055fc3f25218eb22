"""`hspec bench decode`'s llama.cpp column: a build that crashes on this CPU is left out with the fix named,
instead of ending the whole benchmark (ggml's AMX backend segfaults on some AMX CPUs)."""

from __future__ import annotations

import subprocess

from hspec.bench import decode


def test_a_llama_cpp_that_cannot_evaluate_is_reported_with_the_build_that_avoids_amx(tmp_path):
    # A missing GGUF (or a missing llama-cpp-python) fails in the child process, never in this one.
    message = decode.llama_cpp_crash(tmp_path / "missing.gguf", 1)
    assert message is not None and "exit status 1" in message and "left out" in message
    assert decode.LLAMA_CPP_WITHOUT_AMX in message and "-DGGML_NATIVE=OFF" in message


def test_a_segfault_of_the_probe_is_named_as_a_signal(monkeypatch, tmp_path):
    crashed = subprocess.CompletedProcess(args=[], returncode=-11, stdout="", stderr="")
    monkeypatch.setattr(decode.subprocess, "run", lambda *args, **kwargs: crashed)
    message = decode.llama_cpp_crash(tmp_path / "model.gguf", 2)
    assert message is not None and "signal 11" in message and "AMX" in message
    fine = subprocess.CompletedProcess(args=[], returncode=0, stdout="", stderr="")
    monkeypatch.setattr(decode.subprocess, "run", lambda *args, **kwargs: fine)
    assert decode.llama_cpp_crash(tmp_path / "model.gguf", 2) is None
