"""Inference never imports the trainer: drafters load through `hspec.drafters.checkpoint`.

(tests/test_layering.py checks the import graph statically; this checks what an import really loads.)
"""

from __future__ import annotations

import subprocess
import sys


def test_building_a_drafter_loads_no_training_module():
    code = ("import sys, hspec.runtime, hspec.drafters.checkpoint, hspec.decoding.generate, hspec.serving.engine; "
            "print(sorted(m for m in sys.modules if m.startswith('hspec.training')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
