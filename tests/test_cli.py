"""The command table: every command's --help, the lab group and its earlier names, one spelling of a
drafter's checkpoint (KIND=DIR) and of a floating dtype across commands."""

from __future__ import annotations

import argparse

import pytest

from hspec.cli import build_parser, lab, main


def _leaves(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    """(argv, parser) of every runnable command, the groups walked, the hidden earlier names left out."""
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    if sub is None:
        yield prefix, parser
        return
    for choice in sub._choices_actions:  # the listed ones: those with a help line
        yield from _leaves(sub.choices[choice.dest], (*prefix, choice.dest))


def test_every_command_has_a_help_line_and_a_description():
    leaves = list(_leaves(build_parser()))
    assert len(leaves) >= 20 and (("lab", "claims") in dict(leaves))
    for argv, parser in leaves:
        assert parser.description and len(parser.description) > 20, argv
        assert len(parser.format_help().splitlines()) > 4, argv


def test_the_lab_commands_keep_their_earlier_names_out_of_the_help(capsys):
    parser = build_parser()
    run_by = {c.name: c.run for c in lab.LAB_COMMANDS}
    assert parser.parse_args(["eval-merge", "x", "--out", "y"]).handler is run_by["merge"]
    assert parser.parse_args(["claims", "x"]).handler is run_by["claims"]
    assert parser.parse_args(["eval-table", "x"]).handler is run_by["table"]
    assert parser.parse_args(["lab", "table", "x"]).handler is run_by["table"]
    with pytest.raises(SystemExit):
        main(["--help"])
    listed = capsys.readouterr().out.split("{", 1)[1].split("}", 1)[0].split(",")
    assert "lab" in listed and not {"eval-merge", "eval-table", "claims"} & set(listed)


def test_a_drafter_and_its_checkpoint_are_one_value_or_two_flags(tmp_path, capsys):
    from hspec.cli.options import drafter_args, split_kind_path

    args = build_parser().parse_args(["generate", "--prompt", "p", "--drafter", f"hspec={tmp_path}"])
    drafter_args(args)
    assert (args.drafter, args.drafter_path) == ("hspec", str(tmp_path))
    args = build_parser().parse_args(["serve", "--drafter", "hspec", "--drafter-path", str(tmp_path)])
    drafter_args(args)
    assert (args.drafter, args.drafter_path) == ("hspec", str(tmp_path))
    assert split_kind_path("hspec+ngram:0.4") == ("hspec+ngram:0.4", None)
    with pytest.raises(ValueError, match="KIND=DIR"):
        split_kind_path("hspec=")
    assert main(["generate", "--prompt", "p", "--drafter", "hspec=a", "--drafter-path", "b"]) == 2
    assert "names a checkpoint and --drafter-path b another" in capsys.readouterr().err
    args = build_parser().parse_args(["bench", "serve", "--drafters", f"none,hspec={tmp_path}"])
    assert args.drafters == f"none,hspec={tmp_path}"


@pytest.mark.parametrize("argv, dtype", [
    (["generate", "--prompt", "p", "--dtype", "bf16"], "bfloat16"),
    (["export-drafter", "a", "b", "--dtype", "fp16"], "float16"),
    (["export-drafter", "a", "b"], "bfloat16"),
    (["export-gguf", "a", "b", "--dtype", "f32"], "float32"),
    (["drafters", "describe", "--dtype", "fp32"], "float32"),
    (["bench", "vllm", "--dtype", "bf16"], "bfloat16"),
])
def test_one_spelling_of_a_floating_dtype_in_every_command(argv, dtype):
    assert build_parser().parse_args(argv).dtype == dtype


def test_the_command_line_spells_the_librarys_choices():
    """cli/options.py spells the choices so that `--help` imports no torch; they are the library's own."""
    from hspec.cli.options import DRAFTER_PRECISIONS, TARGET_DTYPES, TRAINING_PRECISIONS
    from hspec.models.dtype import DRAFTER_PRECISION_CHOICES, DTYPE_CHOICES
    from hspec.training.precision import PRECISION_CHOICES

    assert TARGET_DTYPES == DTYPE_CHOICES and DRAFTER_PRECISIONS == DRAFTER_PRECISION_CHOICES
    assert TRAINING_PRECISIONS == PRECISION_CHOICES


@pytest.mark.parametrize("argv", [["train", "--drafter", "hspec"], ["lab", "scaling"], ["bench", "train"]])
def test_one_training_precision_in_every_command(argv, capsys):
    """`hspec train`, `lab scaling` and `bench train` (an axis of them) read `--precision` with one parser: the
    same values and spellings, and an error naming the bad value and the allowed ones."""
    parser = build_parser()
    axis = argv[0] == "bench"
    for given, parsed in (("fp32", "fp32"), ("float32", "fp32"), ("bf16-autocast", "bf16-autocast")):
        assert parser.parse_args([*argv, "--precision", given]).precision == ([parsed] if axis else parsed)
    assert parser.parse_args(argv).precision == (["bf16-autocast"] if axis else "auto")
    for bad in ("fp16", "bf16"):  # bf16 alone would read as bf16 weights, which no run keeps
        with pytest.raises(SystemExit):
            parser.parse_args([*argv, "--precision", bad])
        assert f"{bad!r} is not a training precision; allowed: auto, fp32, bf16-autocast" in capsys.readouterr().err
    if axis:
        assert parser.parse_args([*argv, "--precision", "f32,bf16-autocast"]).precision == ["fp32", "bf16-autocast"]
        with pytest.raises(SystemExit):
            parser.parse_args([*argv, "--precision", "auto"])
        assert "not auto" in capsys.readouterr().err
    else:
        assert parser.parse_args([*argv, "--precision", "auto"]).precision == "auto"
