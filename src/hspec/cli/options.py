"""The flags several commands share, each written once, and the parsers of their values.

Every command that loads a target takes `--target` and `--dtype` from here with the same choices; a
drafter is named the same way everywhere: a kind, optionally with its checkpoint as `KIND=DIR` (`--drafter
hspec=DIR`, `--drafters ngram,hspec=DIR`). Floating storage types have one spelling in every command
(float32, bfloat16, float16), and the short ones other tools use (fp32, bf16, fp16, f32, f16) are accepted
for them. Training's `--precision` and the decoding commands' `--drafter-precision` each have one parser
here too (docs/design.md#the-command-line says why they stay apart from `--dtype`).
"""

from __future__ import annotations

import argparse

# The most tokens a step may draft. The target verifies K+1 tokens per step, so a step costs more with
# every draft while acceptance falls off fast with the position (few steps accept 8 tokens here); trained
# drafters allow at most their trained draft length anyway (7 shipped; the paper trains up to 16). 32 leaves
# room for long prompt-lookup copies and stops the likes of --k 5000 (half a minute per step on a CPU).
MAX_DRAFT_LEN = 32

# The target's dtypes (hspec.models.dtype.DTYPE_CHOICES, spelled here so that `--help` imports no torch).
TARGET_DTYPES = ("auto", "fastest", "float32", "bfloat16", "int8", "int4", "w4a8")
# Short names of floating types, as PyTorch's, GGUF's and vLLM's users write them -> hspec's one spelling.
DTYPE_ALIASES = {"fp32": "float32", "f32": "float32", "bf16": "bfloat16", "fp16": "float16", "f16": "float16"}


# `--drafter-precision`: how a trained drafter stores its linear weights inside the target's runtime
# (hspec.models.dtype.DRAFTER_PRECISION_CHOICES).
DRAFTER_PRECISIONS = ("auto", "floating", "int8", "w4a8")
# `--precision`: the arithmetic of drafter training, fp32 or bf16 autocast over fp32 master weights
# (hspec.training.precision.PRECISION_CHOICES). float32's spellings name fp32; bf16 alone names none, since
# it would read as bf16 weights, which no run keeps.
TRAINING_PRECISIONS = ("auto", "fp32", "bf16-autocast")
PRECISION_ALIASES = {"float32": "fp32", "f32": "fp32"}


def dtype_name(text: str) -> str:
    """A `--dtype` value in hspec's spelling (`bf16` -> `bfloat16`); argparse then checks it against the
    command's choices."""
    return DTYPE_ALIASES.get(text, text)


def add_floating_dtype(p: argparse.ArgumentParser, choices: tuple[str, ...], default: str, help: str,
                       flag: str = "--dtype") -> None:
    """A `--dtype` that stores or computes in one of a few floating types (`choices` in hspec's spelling)."""
    p.add_argument(flag, type=dtype_name, choices=choices, default=default,
                   help=f"{help} ({', '.join(choices)}; bf16, fp16, fp32 also accepted; default {default})")


def add_target(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="smollm2",
                   help="HF checkpoint dir (config.json + *.safetensors), a .gguf file, or 'smollm2' "
                        "(the embedded default, SmolLM2-135M-Instruct; default)")


def add_dtype(p: argparse.ArgumentParser, default: str = "auto", flag: str = "--dtype",
              choices: tuple[str, ...] = TARGET_DTYPES) -> None:
    p.add_argument(flag, type=dtype_name, default=default, choices=choices,
                   help=f"weights, KV pool and drafters (default {default}): auto = bfloat16 on a GPU or a CPU with "
                        "native "
                        "bf16 dot products (AVX512-BF16 or AMX), float32 on other CPUs, where bf16 runs slower; "
                        "int8 = the target's linear weights stored as int8 (one scale per row) with bf16 "
                        "activations; int4 = its decoder layers' weights in 4-bit groups of 32 (the default "
                        "GGUF's own Q4_1 levels) and an int8 LM head, with bf16 activations; w4a8 = int4's weights "
                        "with each product's input rows rounded to int8 blocks of 32 (integer dot products, as "
                        "llama.cpp's Q4_1 x Q8_1; needs an x86-64 CPU with AVX2), the fastest plain decoding on a "
                        "CPU; fastest = w4a8 where hspec's CPU kernels run, else auto. int8, int4 and w4a8 are "
                        "slightly different models, so auto never picks them (docs/guide/dtypes.md)")


def add_compile_drafter(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compile-drafter", action="store_true",
                   help="run trained drafters' block forward and greedy loop through torch.compile (inductor), "
                        "and for one sequence on a CPU through AOTInductor libraries (no guards, no Python between "
                        "kernels; ~30-40 s to compile once, then loaded from ~/.cache/hspec): on a 2-core CPU under "
                        "half the eager drafting time, a quarter less than torch.compile alone; drafts may round "
                        "differently, the output never changes (docs/fast-path.md#compiled-drafter, "
                        "#ahead-of-time-drafter)")


def training_precision(text: str) -> str:
    """A `--precision` value (auto, fp32, bf16-autocast; float32 and f32 name fp32) in hspec's spelling; an
    argparse error names the bad value and the allowed ones."""
    name = PRECISION_ALIASES.get(text, text)
    if name not in TRAINING_PRECISIONS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a training precision; allowed: "
                                         f"{', '.join(TRAINING_PRECISIONS)} (fp32 also as float32 or f32)")
    return name


def training_precisions(text: str) -> list[str]:
    """A comma-separated axis of `--precision` values, 'f32,bf16-autocast' -> ['fp32', 'bf16-autocast']: each measured
    arithmetic named, so `auto` is refused (it would record no precision)."""
    values = [training_precision(x) for x in names(text)]
    if not values or "auto" in values:
        raise argparse.ArgumentTypeError(f"{text!r}: an axis of training precisions takes "
                                         f"{', '.join(TRAINING_PRECISIONS[1:])} (comma-separated), not auto")
    return values


def add_training_precision(p: argparse.ArgumentParser, help: str, default: str = "auto", axis: bool = False) -> None:
    """`--precision`, the arithmetic of drafter training, with the same values in every command (`axis`: a
    comma-separated list of them, each configuration of a benchmark)."""
    p.add_argument("--precision", type=training_precisions if axis else training_precision, default=default,
                   help=f"{help} (default {default})")


def add_drafter_precision(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter-precision", default="auto", choices=DRAFTER_PRECISIONS,
                   help="how trained drafters store their linear weights: auto (default) = w4a8 under a w4a8 "
                        "target, int8 under a bfloat16, int8 or int4 target on a CPU, where drafting is bound by "
                        "reading the drafter's weights, else the target's floating dtype; floating; int8 (one scale "
                        "per row, computing in the "
                        "target's dtype); w4a8 (where hspec's w8a8 kernel would multiply int8 weights, the linears, "
                        "head and Markov W2 as w4a8 tiles: int4 levels, fewer bytes). Drafts may change, the output "
                        "never does (docs/fast-path.md#int8-drafter)")


def add_step_cost(p: argparse.ArgumentParser) -> None:
    from hspec.drafters.step_cost import FORM

    p.add_argument("--step-cost", default=None, metavar=FORM,
                   help="the step costs `:auto` drafters choose their draft length by, in 1-token decodes: the "
                        "draft at no context, each verified token at no context, its growth per key of context, "
                        "what verifying any drafted token costs on top (default 0), the draft's growth per key "
                        "of context (default 0) and per position drafted (default 0) (e.g. "
                        "0.6,0.13,8e-5,0.08,1e-4,0.05); default: "
                        "this machine's, measured on first use (~10 s) and cached under "
                        "~/.cache/hspec/step_costs/ (docs/guide/generate.md)")


def step_cost(text: str | None):
    """`--step-cost` parsed before anything loads (None: measured)."""
    from hspec.drafters.step_cost import StepCost

    return None if text is None else StepCost.parse(text)


def add_decoding_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter-option", action="append", default=[], metavar="KEY=VALUE",
                   help="set a decoding option of a trained drafter's saved config (repeatable): a field that "
                        "changes how it drafts, not its weights, e.g. SpecBlock's tree costs for this machine "
                        "(tree_cost_per_node=0.0, adapt_tree=false, node_budget=8: docs/drafters.md); it applies "
                        "to every drafter whose kind has the field, and a key none has lists what each takes")


def add_device(p: argparse.ArgumentParser, default: str = "auto") -> None:
    p.add_argument("--device", default=default,
                   help=f"auto (a CUDA GPU when one is visible, else the CPU), cpu, cuda or cuda:N; under torchrun "
                        f"cuda means each process's own GPU (default {default})")


def add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1]; 1 = off")
    p.add_argument("--top-k", type=int, default=0, help="keep the k best tokens; 0 = off")
    p.add_argument("--seed", type=int, default=0, help="seed of the random draws")


def add_drafter(p: argparse.ArgumentParser, default: str) -> None:
    """`--drafter KIND[=DIR]`, `--k` and `--drafter-path` (the older spelling of `=DIR`); read them with
    `drafter_args`."""
    from hspec.drafters import DRAFTERS

    p.add_argument("--drafter", default=default,
                   help=f"drafter kind: {', '.join(DRAFTERS.names())} (default {default}; none = plain decoding); "
                        "KIND+ngram (e.g. hspec+ngram) drafts by prompt lookup when the last token occurred "
                        "before, by KIND otherwise; a :P suffix (e.g. hspec+ngram:0.4) verifies only the leading "
                        "drafts the drafter is at least P sure of (K stays the most per step), and behind lookup "
                        "2m+1 drafts after an m-token match; a :auto suffix (e.g. ngram:auto, hspec+ngram:auto) "
                        "lets each row verify per step the number of drafts, 0 to K, that pays most by this machine's "
                        "measured step costs, so drafting that does not pay falls back to plain decoding steps; "
                        "KIND:tree (e.g. hspec:tree) verifies a cost-aware token tree grown from a trained block "
                        "drafter; KIND=DIR loads a trained checkpoint (as `hspec eval --drafters` takes it); "
                        "docs/guide/generate.md#drafters")
    p.add_argument("--k", type=int, default=7,
                   help=f"tokens drafted per step (the most per step for :P and :auto), 1 <= K <= {MAX_DRAFT_LEN}; "
                        "a trained drafter allows at most the K it was trained for (7 for the shipped ones) "
                        "(default 7)")
    p.add_argument("--drafter-path", default=None,
                   help="trained drafter checkpoint dir, as --drafter KIND=DIR (default: the one shipped for the "
                        "embedded target); only for trained kinds, not none or ngram")


def drafter_args(args: argparse.Namespace) -> None:
    """Split `--drafter KIND=DIR` into `args.drafter` and `args.drafter_path`, check --k's range, and refuse a
    checkpoint for a drafter that loads none (before any model is loaded)."""
    from hspec.drafters.spec import MODEL_FREE, parse_drafter_spec

    kind, path = split_kind_path(args.drafter)
    if path is not None:
        if args.drafter_path is not None and args.drafter_path != path:
            raise ValueError(f"--drafter {args.drafter} names a checkpoint and --drafter-path {args.drafter_path} "
                             "another; give one of them")
        args.drafter, args.drafter_path = kind, path
    check_draft_len(args.k)
    if args.drafter_path is not None and parse_drafter_spec(args.drafter).base in MODEL_FREE:
        raise ValueError(f"--drafter-path {args.drafter_path} was given, but --drafter {args.drafter} loads no "
                         f"checkpoint ({', '.join(MODEL_FREE)} are model-free); drop --drafter-path or name a "
                         "trained kind, e.g. --drafter hspec")


def split_kind_path(text: str) -> tuple[str, str | None]:
    """'hspec=DIR' -> ('hspec', 'DIR'); 'hspec' -> ('hspec', None); raises ValueError for 'hspec=' or '=DIR'."""
    kind, sep, path = text.partition("=")
    if sep and (not kind or not path):
        raise ValueError(f"a drafter with its checkpoint is KIND=DIR, got {text!r}")
    return kind, path if sep else None


def check_draft_len(K: int, flag: str = "--k") -> None:
    """Raise ValueError unless the draft length K given by `flag` is in 1..MAX_DRAFT_LEN."""
    if not 1 <= K <= MAX_DRAFT_LEN:
        raise ValueError(f"{flag} must be in 1..{MAX_DRAFT_LEN} (tokens drafted per step), got {K}")


def add_data_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", default=None, metavar="DIR",
                   help="folder of the evaluation sets and training prompts (spec_bench.jsonl, ..., "
                        "train_prompts.jsonl[.gz]) instead of the copy shipped in hspec/data "
                        "(default: $HSPEC_DATA_DIR if set, else the shipped copy)")


def add_json(p: argparse.ArgumentParser, instead_of: str) -> None:
    p.add_argument("--json", action="store_true", help=f"print JSON instead of {instead_of}")


class _Renamed(argparse.Action):
    """A flag spelled as before a rename: hidden from `--help`, refused with the new spelling named."""

    def __init__(self, option_strings: list[str], dest: str, new: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS)
        self.new = new

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        parser.error(f"{option_string} is now {self.new}")


def add_renamed(p: argparse.ArgumentParser, old: str, new: str) -> None:
    """Refuse `old`, a flag's spelling before it was renamed `new`, with a message naming `new`."""
    p.add_argument(old, action=_Renamed, new=new, dest=f"renamed_{old.lstrip('-').replace('-', '_')}")


def add_pool_options(p: argparse.ArgumentParser, default_budget_mib: float) -> None:
    p.add_argument("--kv-budget-mib", type=float, default=default_budget_mib,
                   help=f"KV pool memory in MiB, target + drafter layers (default {default_budget_mib:g}); a "
                        "reduced-precision target on the CPU keeps float32 K/V, twice a bf16 pool's bytes per "
                        "token, for faster attention (docs/fast-path.md)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    add_renamed(p, "--block-size", "--page-size")
    p.add_argument("--max-running", type=int, default=128, help="largest decoding batch (default 128)")


def ints(text: str) -> list[int]:
    """'1,16' -> [1, 16]; raises ValueError naming the bad list."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"expected positive integers, got {text!r}")
    return values


def names(text: str) -> list[str]:
    """'ngram,hspec,' -> ['ngram', 'hspec']: a comma-separated list, empty entries dropped."""
    return [x for x in text.split(",") if x]
