"""`hspec kv-table` (the paper's Table 1 from published configs) and `hspec drafters describe` (every
registered kind's parameters and KV cost): what a drafter costs, read without decoding anything."""

from __future__ import annotations

import argparse
import json

from hspec.cli.command import Command, group
from hspec.cli.options import add_floating_dtype, add_json, add_target

# `--dtype` -> the element-size name `describe_kinds` counts bytes in
ELEMENT_TYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def kv_table_arguments(kvt: argparse.ArgumentParser) -> None:
    add_json(kvt, "a Markdown table")


def run_kv_table(args: argparse.Namespace) -> int:
    """Print the KV inflation per token of the known target configs (the paper's Table 1)."""
    from hspec.models.kv_accounting import format_kv_table, kv_table

    rows = kv_table()
    if args.json:
        print(json.dumps([r.to_dict() for r in rows], indent=1), file=args.json_out)
    else:
        print(format_kv_table(rows))
    return 0


def describe_arguments(describe: argparse.ArgumentParser) -> None:
    add_target(describe)
    add_floating_dtype(describe, tuple(ELEMENT_TYPES), "bfloat16", "element size for the byte counts")
    add_json(describe, "a Markdown table")


def run_describe(args: argparse.Namespace) -> int:
    """Describe the registered drafter kinds: parameters, layers read, KV cost."""
    from hspec.drafters.describe import describe_kinds, format_descriptions

    described = describe_kinds(args.target, dtype=ELEMENT_TYPES[args.dtype])
    if args.json:
        print(json.dumps([r.to_dict() for r in described], indent=1), file=args.json_out)
    else:
        print(format_descriptions(described))
    return 0


DRAFTERS_COMMANDS = (
    Command("describe", "parameters, drafter-side KV and per-sequence state of every kind", describe_arguments,
            run_describe,
            description="Per registered kind: trainable/total parameters, drafter KV bytes per token, per-sequence "
                        "state bytes and KV inflation. --target takes what `generate` takes, or a literal config "
                        "(qwen3-4b, qwen3-8b, llama-3.1-8b-instruct, smollm2-135m) built without weights."),
)

COMMANDS = (
    Command("kv-table", "KV inflation per token from model configs (the paper's Table 1)", kv_table_arguments,
            run_kv_table,
            description="(target KV + drafter KV per token) / target KV for Qwen3-4B, Qwen3-8B, "
                        "Llama-3.1-8B-Instruct and SmolLM2-135M with a 5-layer DFlash drafter and with H-Spec, from "
                        "the models' published config values."),
    Command("drafters", "inspect the registered drafter kinds", group(DRAFTERS_COMMANDS, "drafters")),
)
