"""`hspec export-drafter` (a smaller copy of a drafter checkpoint) and `hspec export-gguf` (a drafter for
llama.cpp)."""

from __future__ import annotations

import argparse

from hspec.cli.command import Command
from hspec.cli.options import add_floating_dtype


def export_drafter_arguments(exp: argparse.ArgumentParser) -> None:
    exp.add_argument("src", help="checkpoint directory (config.json + model.safetensors)")
    exp.add_argument("dst", help="output directory")
    add_floating_dtype(exp, ("bfloat16", "float16"), "bfloat16", "storage type of the floating weights")


def run_export_drafter(args: argparse.Namespace) -> int:
    """Copy a drafter checkpoint with its weights stored in a smaller dtype."""
    import torch

    from hspec.drafters.checkpoint import export_drafter

    print(f"wrote {export_drafter(args.src, args.dst, getattr(torch, args.dtype))}")
    return 0


def export_gguf_arguments(exp: argparse.ArgumentParser) -> None:
    exp.add_argument("src", help="drafter checkpoint directory (config.json + model.safetensors)")
    exp.add_argument("dst", help="output .gguf file")
    exp.add_argument("--target", default=None, metavar="GGUF",
                     help="the target's GGUF as llama.cpp runs it (default: the embedded SmolLM2 GGUF)")
    add_floating_dtype(exp, ("float16", "float32"), "float16", "matrices' storage type (norms stay f32)")
    exp.add_argument("--mask-token-id", type=int, default=None, metavar="ID",
                     help="target id whose embedding row carries the learned MASK embedding (default: the last "
                          "special token that is neither BOS nor EOS)")


# `--dtype` -> the GGUF tensor type export_gguf writes
GGUF_TYPES = {"float16": "f16", "float32": "f32"}


def run_export_gguf(args: argparse.Namespace) -> int:
    """Export a drafter to llama.cpp's GGUF and print how to run it."""
    from pathlib import Path

    from hspec.integrations.llama_cpp.export import export_gguf
    from hspec.models.loading import default_gguf_path, resolve_target_dir

    target = Path(args.target).expanduser() if args.target else default_gguf_path()
    if target.suffix != ".gguf" or not target.is_file():
        raise ValueError(f"--target must be the target's .gguf file (llama.cpp runs GGUFs), got {target}")
    _, target_dir = resolve_target_dir(str(target))
    out = export_gguf(args.src, args.dst, target, target_dir, dtype=GGUF_TYPES[args.dtype],
                      mask_token_id=args.mask_token_id)
    print(f"wrote {out.path} ({out.kind}, K <= {out.max_draft_len}, Vp = {out.draft_vocab_size}, "
          f"MASK = id {out.mask_token_id})")
    print("run it: llama-cli " + " ".join(out.llama_cli_args(target)))
    return 0


COMMANDS = (
    Command("export-drafter", "copy a drafter checkpoint with weights stored in bf16/fp16", export_drafter_arguments,
            run_export_drafter,
            description="Ship a trained drafter smaller: floating weights are cast to --dtype (loading casts them "
                        "back); the draft vocabulary ids stay exact."),
    Command("export-gguf", "a dflash/dspark drafter as the GGUF llama.cpp drafts with", export_gguf_arguments,
            run_export_gguf,
            description="Write an hspec DFlash or DSpark checkpoint as llama.cpp's drafter GGUF (its `dflash` "
                        "architecture) and print the llama-cli line that runs it (--spec-type draft-dspark: the "
                        "block layout hspec trains; docs/llama-cpp.md)."),
)
