"""`hspec data generate`: parts of one prompt order, resume after a kill, settings guard."""

import json

import pytest

from hspec.training.datagen import DataGenSettings, generate_corpus, read_corpus


@pytest.fixture()
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [{"id": f"p/{i}", "category": "t", "turns": [f"prompt number {i} " + "x" * (i % 5)]} for i in range(12)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _settings(prompts_file, **overrides) -> DataGenSettings:
    base = dict(target="tiny", prompts_file=str(prompts_file), max_new_tokens=5, batch_size=3)
    return DataGenSettings(**{**base, **overrides})


def test_parts_partition_one_order(tmp_path, prompts_file, tiny_target):
    whole = read_corpus(generate_corpus(_settings(prompts_file, num_prompts=8), tmp_path / "whole.jsonl", tiny_target))
    first = read_corpus(generate_corpus(_settings(prompts_file, num_prompts=5), tmp_path / "a.jsonl", tiny_target))
    second = read_corpus(generate_corpus(_settings(prompts_file, num_prompts=3, skip_prompts=5),
                                         tmp_path / "b.jsonl", tiny_target))
    assert [r["id"] for r in first + second] == [r["id"] for r in whole]
    assert [r["response_ids"] for r in first + second] == [r["response_ids"] for r in whole]


def test_resume_after_torn_line_finishes_the_same_corpus(tmp_path, prompts_file, tiny_target):
    settings = _settings(prompts_file, num_prompts=7)
    reference = (generate_corpus(settings, tmp_path / "ref.jsonl", tiny_target)).read_text()
    out = tmp_path / "killed.jsonl"
    lines = reference.split("\n")
    out.write_text("\n".join(lines[:4]) + "\n" + lines[4][:10])  # killed mid-write of the 5th record
    (tmp_path / "killed.settings.json").write_text((tmp_path / "ref.settings.json").read_text())
    generate_corpus(settings, out, tiny_target)
    assert sorted(out.read_text().split("\n")) == sorted(reference.split("\n"))


def test_other_settings_refuse_to_append(tmp_path, prompts_file, tiny_target):
    out = generate_corpus(_settings(prompts_file, num_prompts=2), tmp_path / "c.jsonl", tiny_target)
    with pytest.raises(ValueError, match="different settings"):
        generate_corpus(_settings(prompts_file, num_prompts=2, skip_prompts=1), out, tiny_target)


@pytest.mark.parametrize("field, value", [("skip_prompts", -1), ("num_prompts", 0), ("batch_size", 0)])
def test_bad_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        DataGenSettings(**{field: value})
