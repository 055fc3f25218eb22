"""No test replaces one of hspec's own functions, methods or classes: the code under test takes what a test
varies as an argument (a seam: `run_eval(build=..., decoder=...)`, `train(cpu_flags=..., on_step=...)`,
`load_target(tokenizer=...)`), and the test hands it in. Replacing a function of torch, the standard library
or another package to inject a fault (a failing save, a missing GPU, a broken compiler) stays allowed, as does
changing a data attribute (a path, a flag).

conftest.py checks every test's `monkeypatch.setattr` calls with `replaced_project_functions` when it ends.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

# Replacements that remain, by the replaced function's qualified name, each with why it has no seam yet.
STILL_REPLACED: dict[str, str] = {}


def replaced_project_functions(replacements: Iterable[tuple[Any, str, Any]]) -> list[str]:
    """The hspec functions, methods and classes among `replacements`, as pytest's MonkeyPatch records its
    setattr calls: (object, attribute name, the value before); each named with where it was replaced, less
    the ones `STILL_REPLACED` lists."""
    found = []
    for owner, name, before in replacements:
        original = before.__func__ if isinstance(before, (staticmethod, classmethod)) else before
        if not (inspect.isfunction(original) or inspect.ismethod(original) or inspect.isclass(original)):
            continue  # data, or an instance
        module = getattr(original, "__module__", None) or ""
        if module != "hspec" and not module.startswith("hspec."):
            continue  # torch's, the standard library's, another package's: fault injection
        qualified = f"{module}.{original.__qualname__}"
        if qualified not in STILL_REPLACED:
            where = owner.__name__ if inspect.ismodule(owner) or inspect.isclass(owner) else type(owner).__name__
            found.append(f"{qualified} (as {where}.{name})")
    return found
