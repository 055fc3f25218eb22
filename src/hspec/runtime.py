"""From command-line names to ready objects: a drafter of a kind for a loaded target.

Trained kinds load a checkpoint: the one given, or the drafter shipped for the embedded default
target under `hspec/assets/<kind>-<target>/`. Model-free kinds (`none`, `ngram`) need nothing.
`KIND+ngram` (e.g. `hspec+ngram`) is KIND behind prompt lookup (`hspec.drafters.lookup_first`).
`SPEC:P` (e.g. `hspec:0.4`, `hspec+ngram:0.4`) verifies only the drafts KIND is at least P sure of,
and behind lookup only 2m+1 drafts after an m-token match (`hspec.drafters.early_stop`).
`SPEC:auto` (e.g. `hspec:auto`, `hspec+ngram:auto`) verifies, per row and step, the number of drafts that
pays most on this machine, 0 included (`hspec.drafters.cost_aware`), from costs measured once and cached.
`compiled=True` runs a trained drafter's block forward through torch.compile (`hspec.drafters.compile`);
`precision` stores its linear weights as int8 or floating (`hspec.models.dtype.drafter_int8`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from hspec.decoding.step_cost import cached_step_cost, measure_step_cost
from hspec.drafters import DRAFTERS, Drafter, create_drafter
from hspec.drafters.base import drafter_config, parse_config_options
from hspec.drafters.block_tree import BlockTreeDrafter
from hspec.drafters.checkpoint import load_drafter
from hspec.drafters.common import NeuralDrafter
from hspec.drafters.compile import compile_drafter
from hspec.drafters.cost_aware import CostAwareDrafter
from hspec.drafters.early_stop import EarlyStopDrafter
from hspec.drafters.hspec.native import native_propose_for
from hspec.drafters.lookup_first import LookupFirstDrafter
from hspec.drafters.outlook import Outlook, load_outlook
from hspec.drafters.spec import parse_drafter_spec
from hspec.drafters.step_cost import StepCost
from hspec.models.dtype import cpu_has_native_bf16, drafter_int8
from hspec.models.formats.store import quantize_drafter_w4a8, quantize_int8, quantize_w8a8
from hspec.models.layers import RMSNorm
from hspec.models.loading import Target, cache_root
from hspec.models.native import integer_capability, kernels_loaded
from hspec.models.weight_layout import store_linear_weights_in_fast_layout

ASSETS = Path(__file__).resolve().parent / "assets"
NATIVE_DRAFTER_ENV = "HSPEC_NATIVE_DRAFTER"  # "0": drafters propose in Python (`prepare_for_inference`)
COST_PROBE_K = 7  # the draft length `:auto` measures a drafter's costs at unless told (the shipped drafters' K)


def shipped_drafter_path(kind: str, target_name: str) -> Path:
    """Where the drafter of `kind` shipped for `target_name` lives (it may not exist)."""
    return ASSETS / f"{kind}-{target_name.lower()}"


def build_drafter(kind: str, target: Target, path: str | Path | None = None, random_weights: bool = False,
                  compiled: bool = False, precision: str = "auto", options: Mapping[str, Any] | None = None,
                  K: int = COST_PROBE_K, step_cost: StepCost | None = None) -> Drafter:
    """A drafter of `kind` for `target`: loaded from `path` (or the shipped one), or random for tests/timing.

    `KIND+ngram` builds KIND this way and puts prompt lookup in front of it; a `:P` suffix stops
    each row's drafts at the first one of confidence below P (the grammar: `hspec.drafters.spec`).
    `compiled`: a trained kind's block forward runs through torch.compile; `precision` (auto, floating,
    int8) stores its linear weights (`for_inference`). Model-free kinds ignore both. `options`: decoding
    options set on the trained kind's config (`decoding_options_of`; none for a model-free kind).
    `K`, `step_cost`: for `:auto`, the draft length the costs are measured at and the costs themselves
    (None: this machine's, measured once and cached, `step_cost_of`).
    """
    spec = parse_drafter_spec(kind)
    if spec.tree:
        model = build_drafter(spec.base, target, path, random_weights, compiled, precision, options)
        return BlockTreeDrafter(model, step_cost or step_cost_of(model, target, K, path, precision, compiled))  # type: ignore[arg-type]
    if spec.wrapped:
        model = build_drafter(spec.base, target, path, random_weights, compiled, precision, options)
        if spec.confidence_floor is not None:
            model = EarlyStopDrafter(model, spec.confidence_floor)
        if spec.lookup:  # behind lookup, `:P` also trims lookup rows to 2m+1 drafts
            model = LookupFirstDrafter(model, target.config.vocab_size, trim_lookup=spec.confidence_floor is not None)
        if spec.adaptive_length:  # around everything: lookup rows too get their length by cost
            cost = step_cost or step_cost_of(model, target, K, path, precision, compiled)
            outlook = None if random_weights else outlook_of(spec.base, target, path)
            model = CostAwareDrafter(model, target.config.vocab_size, cost, outlook=outlook)
        return model
    cls = DRAFTERS.get(kind)
    if not cls.needs_target_model:
        if options:
            raise ValueError(f"drafter {kind!r} is model-free and takes no drafter options, got {sorted(options)}")
        if path is not None:  # a checkpoint the user expects to be used would be silently ignored
            raise ValueError(f"drafter {kind!r} is model-free and loads no checkpoint, but a path was given "
                             f"({path}); pass a path only with a trained kind, e.g. hspec")
        return create_drafter(kind, target.config)
    if random_weights:
        chosen = {"config": drafter_config(kind, target.config, **options)} if options else {}
        drafter = create_drafter(kind, target.config, target_model=target.model, **chosen)
        return for_inference(drafter, target, compiled, precision)
    checkpoint = Path(path) if path is not None else shipped_drafter_path(kind, target.name)
    if not (checkpoint / "config.json").exists():
        raise FileNotFoundError(
            f"no trained {kind!r} drafter at {checkpoint}; pass --drafter-path DIR (a checkpoint from "
            f"`hspec train --drafter {kind}`), or use --drafter ngram / none"
        )
    drafter = load_drafter(checkpoint, target.model, options=options)
    if drafter.kind != kind:
        raise ValueError(f"checkpoint {checkpoint} holds a {drafter.kind!r} drafter, not {kind!r}")
    return for_inference(drafter, target, compiled, precision)


def outlook_of(kind: str, target: Target, path: str | Path | None = None) -> Outlook | None:
    """The outlook (`drafters/outlook.py`) beside the checkpoint of trained kind `kind` (`path`, or the shipped
    one), or None: a model-free kind, or a checkpoint without one."""
    if not DRAFTERS.get(kind).needs_target_model:
        return None
    return load_outlook(Path(path) if path is not None else shipped_drafter_path(kind, target.name))


def step_cost_of(drafter: Drafter, target: Target, K: int = COST_PROBE_K, path: str | Path | None = None,
                 precision: str = "auto", compiled: bool = False) -> StepCost:
    """This machine's StepCost for `drafter` on `target`, measured once (about ten seconds) and cached under
    `cache_root()/step_costs/` (`decoding.step_cost`). Behind prompt lookup (`KIND+ngram`) the costs are its
    model's: a row the lookup drafts pays no draft (`CostAwareDrafter.free_cost`), so the draft to charge is the
    model's, which a decode whose lookup keeps matching (a greedy decode from random tokens repeats itself)
    would never time."""
    if isinstance(drafter, LookupFirstDrafter):
        drafter = drafter.model
    what = (target.name, target.model.dtype_name, drafter.kind, str(path or "shipped"),
            drafter_precision_of(precision, target), compiled, K)
    return cached_step_cost(cache_root() / "step_costs", what, lambda: measure_step_cost(target.model, drafter, K))


def decoding_options_of(kinds: Sequence[str], options: Sequence[str]) -> dict[str, dict[str, Any]]:
    """A decoding command's `--drafter-option KEY=VALUE` strings -> the options of each kind in `kinds` (a
    composite KIND+ngram:P counts as KIND): each option goes to every kind whose config names KEY among its
    `decoding_options`. An option no kind takes raises ValueError naming what each kind takes."""
    bases = {kind: parse_drafter_spec(kind).base for kind in kinds}
    offered = {kind: getattr(DRAFTERS.get(base).config_class, "decoding_options", ()) for kind, base in bases.items()}
    out: dict[str, dict[str, Any]] = {kind: {} for kind in kinds}
    for option in options:
        takers = [kind for kind in kinds if option.partition("=")[0] in offered[kind]]
        if not takers:
            listed = {kind: list(fields) for kind, fields in offered.items()}
            raise ValueError(f"--drafter-option {option!r}: no drafter here takes it; the decoding options of each "
                             f"are {listed} (KEY=VALUE)")
        for kind in takers:
            out[kind].update(parse_config_options(bases[kind], [option], decoding=True))
    return out


def drafter_precision_of(precision: str, target: Target) -> str:
    """What `--drafter-precision` means for `target`: "w4a8", "int8" or "floating" (what results files record)."""
    device = target.model.embed_tokens.weight.device
    if not drafter_int8(precision, target.model.dtype_name, device):
        return "floating"
    w4a8 = w4a8_drafter(precision, target.model.dtype_name)
    return "w4a8" if w4a8 and int8_kernel(target.model.dtype_name, device) == "w8a8" else "int8"


def w4a8_drafter(precision: str, target_dtype: str) -> bool:
    """Whether a drafter whose weights go int8 takes w4a8 tiles where hspec's w8a8 kernel would multiply them:
    when asked (`--drafter-precision w4a8`) and, by default, under a w4a8 target, where the drafter's proposal is
    bound by reading its weights and the tiles read ~5/8 of int8's bytes; it drafts as well as the int8 one
    (`results/drafter_precision/`, docs/fast-path.md#int8-drafter)."""
    return precision == "w4a8" or (precision == "auto" and target_dtype == "w4a8")


def for_inference(drafter: Drafter, target: Target, compiled: bool = False, precision: str = "auto") -> Drafter:
    """`prepare_for_inference` for a drafter of `target` (its dtype and device)."""
    return prepare_for_inference(drafter, target.model.dtype_name, target.model.embed_tokens.weight.device,
                                 compiled, precision)


def int8_kernel(target_dtype: str, device: torch.device | str) -> str:
    """Which kernel multiplies an int8 drafter's weights (`models.formats.store.int8_weight`): on a CPU whose target
    loaded hspec's kernels (`models.native.load_kernels`) its w8a8 one (the drafter's rows rounded to int8
    blocks) under a w4a8 target or where the CPU has AVX512-VNNI, its int8 one otherwise; elsewhere torch's.
    On an AVX2-only CPU, 7 drafted rows through a (1536, 576) linear took 249 us in torch's kernel, 99 in
    hspec's int8 one and 70 in its w8a8 one; with AVX512-VNNI, 115 in the int8 one and 32 in the w8a8 one
    (docs/fast-path.md#int8-drafter)."""
    if torch.device(device).type != "cpu" or not kernels_loaded():
        return "torch"
    return "w8a8" if target_dtype == "w4a8" or integer_capability() == "avx512_vnni" else "int8"


def prepare_for_inference(drafter: Drafter, target_dtype: str, device: torch.device | str, compiled: bool = False,
                          precision: str = "auto", native: bool | None = None) -> Drafter:
    """Eval mode, linear weights in the layout multi-row CPU forwards prefer (see models/weight_layout),
    int8 linears where `precision` asks for them (`drafter_int8` for a target running in `target_dtype`
    on `device`; by default under a bf16, int8 or int4 target on a CPU: drafts may change, never the output),
    with `compiled` the tensor-only forwards through torch.compile, and with `native` (None: unless the
    environment sets HSPEC_NATIVE_DRAFTER=0) an H-Spec drafter's greedy proposal of one CPU sequence as one
    native call (drafters/hspec/native.py: the same drafts, built once per machine), which then takes those
    proposals from the compiled forwards too."""
    store_linear_weights_in_fast_layout(drafter)
    if drafter_int8(precision, target_dtype, device) and isinstance(drafter, NeuralDrafter):
        drafter.requires_grad_(False)
        compute_dtype = drafter.mask_embedding.dtype
        kernel = int8_kernel(target_dtype, device)
        if kernel == "w8a8" and w4a8_drafter(precision, target_dtype):  # the layers, the head's rows, W2 in w4a8 tiles
            quantize_drafter_w4a8(drafter, compute_dtype)
            kernel = "w4a8"
        elif kernel == "w8a8":
            quantize_w8a8(drafter, compute_dtype)
        else:
            quantize_int8(drafter, compute_dtype, kernels=kernel == "int8")
        if kernel in ("w8a8", "w4a8") or (kernel == "int8" and not cpu_has_native_bf16()):  # else oneDNN's bf16
            drafter.head.store_int8(compute_dtype, kernel)
        drafter.store_int8(compute_dtype, kernel)
    if isinstance(drafter, NeuralDrafter) and torch.device(device).type == "cpu" and kernels_loaded():
        # bf16 norms in hspec's kernel, as the target's (`loading.build_model`): ~1 us a call where F.rms_norm
        # took ~30 (18 calls a proposal); it may round otherwise in the last bit, so drafts may change, never
        # the output
        for module in drafter.modules():
            if isinstance(module, RMSNorm):
                module.kernel = True
    drafter = drafter.eval()
    if compiled and isinstance(drafter, NeuralDrafter):
        compile_drafter(drafter)
    if native is None:
        native = os.environ.get(NATIVE_DRAFTER_ENV, "1") != "0"
    if native and isinstance(drafter, NeuralDrafter) and torch.device(device).type == "cpu":
        drafter.native_greedy = native_propose_for(drafter)  # after every change of its weights' storage
    return drafter
