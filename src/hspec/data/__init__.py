"""The data that ships with hspec: evaluation sets and training prompts, with the loaders that read them.

The lowest floor above the standard library: `eval/`, `bench/` and `training/` import it, it imports
nothing of hspec. The files sit in this folder (sources and licences in README.md); every reader takes
a `data_dir` (the CLI's `--data-dir`) or $HSPEC_DATA_DIR to read another folder of the same files.
"""
