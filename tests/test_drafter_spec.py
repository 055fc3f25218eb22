"""The drafter-name grammar (`KIND`, `KIND+ngram`, `KIND:P`, `KIND+ngram:P`) read in one place."""

from __future__ import annotations

import pytest

from hspec.drafters.spec import DrafterSpec, parse_drafter_spec


@pytest.mark.parametrize("text,expected", [
    ("hspec", DrafterSpec("hspec")),
    ("none", DrafterSpec("none")),
    ("dspark+ngram", DrafterSpec("dspark", lookup=True)),
    ("hspec:0.4", DrafterSpec("hspec", confidence_floor=0.4)),
    ("hspec+ngram:0.25", DrafterSpec("hspec", lookup=True, confidence_floor=0.25)),
])
def test_parses_every_form(text, expected):
    assert parse_drafter_spec(text) == expected


@pytest.mark.parametrize("text,message", [
    ("hspec:1", "a number in \\(0, 1\\).*'auto'.*or 'tree'.*got '1'"),
    ("hspec:", "a number in \\(0, 1\\).*'auto'.*or 'tree'.*got ''"),
    ("hspec+ngram:x", "a number in \\(0, 1\\).*'auto'.*or 'tree'.*got 'x'"),
    ("ngram:0.5", "only trained drafters"),
    ("none+ngram", "in front of a trained drafter kind"),
])
def test_bad_names_say_what_is_allowed(text, message):
    with pytest.raises(ValueError, match=message):
        parse_drafter_spec(text)
