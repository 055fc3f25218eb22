"""The guard against tests that replace hspec's own functions (tests/project_patches.py) catches them and
lets fault injection through."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from project_patches import STILL_REPLACED, replaced_project_functions

TESTS = Path(__file__).resolve().parent


def _replacements(*patches) -> list:
    """What MonkeyPatch records for `patches` ((target, name, value) each), undone at once."""
    with pytest.MonkeyPatch.context() as mp:
        for owner, name, value in patches:
            mp.setattr(owner, name, value)
        return list(mp._setattr)


def test_replacing_a_project_function_method_or_class_is_caught():
    from hspec.decoding.generate import SpeculativeDecoder
    from hspec.drafters.ahead_of_time import AheadOfTimeForward
    from hspec.eval import runner

    found = replaced_project_functions(_replacements(
        (runner, "build_drafter", lambda *a, **k: None),  # imported into the runner from hspec.runtime
        (SpeculativeDecoder, "generate", lambda *a, **k: None),
        (AheadOfTimeForward, "covers", staticmethod(lambda ctx: False)),
        (runner, "MethodSpec", object)))
    assert found == ["hspec.runtime.build_drafter (as hspec.eval.runner.build_drafter)",
                     "hspec.decoding.generate.SpeculativeDecoder.generate (as SpeculativeDecoder.generate)",
                     "hspec.drafters.ahead_of_time.AheadOfTimeForward.covers (as AheadOfTimeForward.covers)",
                     "hspec.eval.runner.MethodSpec (as hspec.eval.runner.MethodSpec)"]


def test_faults_injected_into_torch_or_the_standard_library_and_data_attributes_pass():
    from hspec.models import native
    from hspec.training import checkpoint

    assert replaced_project_functions(_replacements(
        (checkpoint.torch, "save", lambda *a, **k: None),
        (torch.cuda, "is_available", lambda: False),
        (checkpoint, "save_file", lambda *a, **k: None),  # safetensors' function, as imported there
        (native, "_SOURCE", Path("broken.cpp")))) == []


def test_every_replacement_still_allowed_is_still_made():
    """An entry of STILL_REPLACED whose replacement is gone from the tests goes too."""
    patched = {m.group(1) for path in TESTS.glob("test_*.py")
               for m in re.finditer(r'monkeypatch\.setattr\([^,]+, "(\w+)"', path.read_text())}
    assert {name.rsplit(".", 1)[1] for name in STILL_REPLACED} <= patched
