"""Losslessness of the generate loop, for every registered drafter kind and a random test drafter.

Greedy: speculative output == plain greedy output, token for token. Sampling: the output has the
target's distribution (a chi-square test with a stated false-failure probability, no reruns).
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from hspec.decoding.generate import SpeculativeDecoder
from hspec.drafters import DRAFTERS, create_drafter
from hspec.drafters.base import DraftBatch, Drafter, Proposal
from hspec.drafters.block_tree import BlockTreeDrafter
from hspec.drafters.cost_aware import CostAwareDrafter
from hspec.drafters.early_stop import EarlyStopDrafter
from hspec.drafters.lookup_first import LookupFirstDrafter
from hspec.drafters.outlook import Outlook
from hspec.drafters.spec import parse_drafter_spec
from hspec.drafters.step_cost import StepCost
from hspec.sampling import SamplingParams

PROMPTS = ["hello world, hello world", "abcabcabcabc", "the quick brown fox"]


class RandomDrafter(Drafter):
    """Drafts from random distributions: the harshest input for the verifier."""

    kind = "random-test"

    def __init__(self, vocab_size: int, sharpness: float = 3.0) -> None:
        self.vocab_size, self.sharpness = vocab_size, sharpness

    def propose(self, batch: DraftBatch, K: int) -> Proposal:
        rows_t, rows_q = [], []
        for g in batch.generators:
            q = torch.softmax(self.sharpness * torch.randn(K, self.vocab_size, generator=g), -1)
            rows_q.append(q)
            rows_t.append(torch.multinomial(q, 1, generator=g).squeeze(-1))
        tokens, probs = torch.stack(rows_t), torch.stack(rows_q)
        return Proposal(tokens, probs, confidence=probs.gather(-1, tokens[..., None])[..., 0])


def _decoder(target, drafter, K):
    return SpeculativeDecoder(target.model, drafter, K, target.tokenizer.eos_token_ids, target.tokenizer.decode)


def _make(kind, target):
    if kind == WITH_OUTLOOK:  # H-Spec's cost-aware length, an outlook deciding which steps draft
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = _make("hspec", target)
            features = len(model.target_layers) * target.config.hidden_size
            weight = torch.randn((7, features)) * 6.0 / features ** 0.5
        outlook = Outlook(weight, torch.full((7,), -2.0), tuple(model.target_layers))
        return CostAwareDrafter(model, target.config.vocab_size, OUTLOOK_COST, outlook=outlook)
    spec = parse_drafter_spec(kind)  # the grammar `hspec.runtime.build_drafter` reads
    if spec.tree:  # greedy rows verify token trees, sampled rows their chains as trees
        with torch.random.fork_rng():
            torch.manual_seed(0)
            return BlockTreeDrafter(_make(spec.base, target), TREE_COSTS[kind])
    if spec.adaptive_length:  # rows verify 0..K drafts and back off drafting, by the costs below
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = _make(spec.base, target)
        if spec.lookup:
            model = LookupFirstDrafter(model, target.config.vocab_size, min_match=2)
        return CostAwareDrafter(model, target.config.vocab_size, ADAPTIVE_COST)
    if spec.confidence_floor is not None:  # rows verify a varying number of drafts
        with torch.random.fork_rng():  # the same weights in any test order, so the floor keeps mixing
            torch.manual_seed(0)
            model = EarlyStopDrafter(_make(spec.base, target), spec.confidence_floor)
        if spec.lookup:
            return LookupFirstDrafter(model, target.config.vocab_size, min_match=2, trim_lookup=True)
        return model
    if kind == "random-test":
        return RandomDrafter(target.config.vocab_size)
    if spec.lookup:  # prompt lookup in front of a trained kind; a short min_match mixes rows more
        model = create_drafter(spec.base, target.config, target_model=target.model)
        return LookupFirstDrafter(model, target.config.vocab_size, min_match=LOOKUP_FIRST[kind])
    return create_drafter(kind, target.config, target_model=target.model)


# P-Eagle queues its context entries between proposals, so skipped proposals exercise its queue.
LOOKUP_FIRST = {"hspec+ngram": 2, "peagle+ngram": 1}
# Floors near the median confidence of these random-weight drafters, so stopping points vary. DFlash
# writes its own context K/V for every verified position, so a shorter block exercises its commit.
EARLY_STOP = ("hspec:0.1", "hspec+ngram:0.1", "dflash:0.07", "random-test:0.05")
# Costs at which these random-weight drafters' confidences (~0.05-0.15) make some steps verify 0 drafts and
# back off, and others verify several: a drafted token costs 0.05 decodes, drafting 0.02.
ADAPTIVE_COST = StepCost(draft=0.02, per_token=0.05, per_token_key=0.0)
ADAPTIVE = ("hspec:auto", "hspec+ngram:auto", "dflash:auto", "ngram:auto")
# Not a drafter string: `hspec:auto` with a random outlook (hspec.drafters.outlook) that drafts on some steps
# and not others, as one fitted to a trained drafter does.
WITH_OUTLOOK = "hspec:auto+outlook"
# its costs: a draft that grows with its positions, so a row drafts (and its sampled rows draw) only the length its
# outlook expects to pay, under K on some steps
OUTLOOK_COST = StepCost(draft=0.02, per_token=0.05, per_token_key=0.0, draft_per_position=0.05)
# Costs at which the random-weight drafters grow trees of several nodes (dflash) or back off on most steps
# between trees (hspec: a drafted token's value ~0.3 does not pay for a draft of 0.3 decodes).
TREE_COSTS = {"hspec:tree": StepCost(draft=0.3, per_token=0.005, per_token_key=0.0),
              "dflash:tree": StepCost(draft=0.06, per_token=0.005, per_token_key=0.0)}
TREES = tuple(TREE_COSTS)
ALL_KINDS = [k for k in DRAFTERS.names() if k != "none"] + ["random-test", *LOOKUP_FIRST, *EARLY_STOP, *ADAPTIVE,
                                                            WITH_OUTLOOK, *TREES]


@pytest.fixture(scope="module")
def targets_by_dtype(tiny_dirs):
    """The tiny target loaded in each dtype `--dtype` offers: the target, its pool and the drafters built
    on it all run in that dtype, and greedy speculative output must equal plain output of the same dtype."""
    from conftest import load_tiny
    from hspec.models.native import load_kernels

    names = ("float32", "bfloat16", "int8", "int4") + (("w4a8",) if load_kernels() else ())  # w4a8: kernels only
    return {name: load_tiny(tiny_dirs["llama"], dtype=name) for name in names}


# Every (B, K) in float32; two each in bfloat16, int8 and int4 (bf16 activations), whose matrix products
# are emulated (and slow) on CPUs without native bf16, so that the default suite stays short there; one
# in w4a8 (int4's weights on other kernels, the same code around them).
GREEDY_GRID = [("float32", B, K) for B, K in itertools.product([1, 3], [1, 3, 4, 5, 7])] + [
    ("bfloat16", 1, 7), ("bfloat16", 3, 4), ("int8", 1, 5), ("int8", 3, 7), ("int4", 1, 7), ("int4", 3, 3),
    ("w4a8", 3, 5)]


@pytest.mark.parametrize("kind", ALL_KINDS)
@pytest.mark.parametrize("dtype,B,K", GREEDY_GRID)
def test_greedy_equals_plain(targets_by_dtype, kind, dtype, B, K):
    if dtype not in targets_by_dtype:
        pytest.skip(f"--dtype {dtype} needs hspec's CPU kernels, which do not run here")
    tiny_target = targets_by_dtype[dtype]
    prompts = [tiny_target.tokenizer.encode_prompt(p) for p in PROMPTS[:B]]
    plain = _decoder(tiny_target, create_drafter("none", tiny_target.config), 1)
    drafter = _make(kind, tiny_target)
    spec = _decoder(tiny_target, drafter, K)
    expected = plain.generate(prompts, SamplingParams(), 40)
    got = spec.generate(prompts, SamplingParams(), 40)
    for e, s in zip(expected.sequences, got.sequences):
        assert s.token_ids == e.token_ids and s.finish_reason == e.finish_reason
        assert all(0 <= n <= d <= K for n, d in zip(s.num_accepted, s.num_drafted, strict=True))
    if kind in EARLY_STOP and K > 1:
        assert min(n for s in got.sequences for n in s.num_drafted) < K, "no row ever stopped early"
    if kind == "hspec:tree" and dtype == "float32":
        assert 0 in {d for s in got.sequences for d in s.num_drafted}, "no row ever backed off"
    if kind == WITH_OUTLOOK and dtype == "float32":
        lengths = {d for s in got.sequences for d in s.num_drafted}
        assert 0 in lengths and max(lengths) > 0, "the outlook should keep some steps plain and let others draft"


TRAINED_KINDS = [k for k in DRAFTERS.names() if DRAFTERS.get(k).needs_target_model]


@pytest.mark.parametrize("kind", TRAINED_KINDS)
def test_int8_drafter_weights_under_a_bf16_target_keep_greedy_output(targets_by_dtype, kind):
    """`--drafter-precision auto` stores a trained drafter's linears as int8 under a bf16 target on a CPU
    (`hspec.runtime.prepare_for_inference`): its drafts change, the output must not, for every kind."""
    from hspec.models.dtype import cpu_has_native_bf16
    from hspec.models.layers import Linear
    from hspec.models.native import integer_capability, kernels_loaded
    from hspec.runtime import build_drafter

    tiny_target = targets_by_dtype["bfloat16"]
    torch.manual_seed(0)
    drafter = build_drafter(kind, tiny_target, random_weights=True)
    int8_linears = [m for m in drafter.modules() if isinstance(m, Linear) and m.weight.dtype == torch.int8]
    assert int8_linears
    if kernels_loaded():  # the target runs hspec's CPU kernels: the drafter's int8 products run there
        assert all(m.weight_packed is not None for m in int8_linears)
        vnni = integer_capability() == "avx512_vnni"  # then the w8a8 kernel, head included (`runtime.int8_kernel`)
        assert (drafter.head._int8 is not None) == (vnni or not cpu_has_native_bf16())  # else where bf16 is software
        assert any(m.weight_packed.dim() == 3 for m in int8_linears) == vnni  # pack_w8a8's tiles
    prompts = [tiny_target.tokenizer.encode_prompt(p) for p in PROMPTS]
    plain = _decoder(tiny_target, create_drafter("none", tiny_target.config), 1)
    expected = plain.generate(prompts, SamplingParams(), 32)
    got = _decoder(tiny_target, drafter, 4).generate(prompts, SamplingParams(), 32)
    for e, s in zip(expected.sequences, got.sequences):
        assert s.token_ids == e.token_ids and s.finish_reason == e.finish_reason


@pytest.mark.parametrize("precision", ["int8", "auto"])
def test_a_drafter_under_a_w4a8_target_multiplies_int8_rows_as_its_target(targets_by_dtype, precision):
    """Under a w4a8 target the drafter's int8 linears and head run in hspec's w8a8 kernel where it takes their
    shape (`runtime.int8_kernel`: rows rounded to int8 blocks; hspec's int8 kernel elsewhere), the Markov head
    too; by default (auto) the linears the int4 kernels take are w4a8 tiles instead (`runtime.w4a8_drafter`);
    the output stays plain w4a8 decoding's."""
    from collections import Counter

    from hspec.models.layers import Linear
    from hspec.runtime import build_drafter

    if "w4a8" not in targets_by_dtype:
        pytest.skip("hspec's CPU kernels do not run here")
    target = targets_by_dtype["w4a8"]
    torch.manual_seed(0)
    drafter = build_drafter("hspec", target, random_weights=True, precision=precision)
    linears = [m for m in drafter.modules() if isinstance(m, Linear)]
    formats = Counter(type(m.weight_format).__name__ for m in linears)
    if precision == "int8":
        assert set(formats) <= {"W8A8", "Int8"} and formats["W8A8"] > 0  # pack_w8a8's tiles where they fit
    else:
        assert formats["W4A8"] > formats["W8A8"] and set(formats) <= {"W4A8", "W8A8", "Int8"}
    assert drafter.head._int8.packed.dim() == 3 and drafter.markov._w2_int8.packed.dim() == 3
    prompts = [target.tokenizer.encode_prompt(p) for p in PROMPTS]
    plain = _decoder(target, create_drafter("none", target.config), 1).generate(prompts, SamplingParams(), 32)
    got = _decoder(target, drafter, 4).generate(prompts, SamplingParams(), 32)
    assert [s.token_ids for s in got.sequences] == [s.token_ids for s in plain.sequences]


def test_eos_inside_a_block_ends_the_sequence(tiny_target):
    """Make the token greedy decoding emits 5th an EOS: speculative output must stop exactly there."""
    prompts = [tiny_target.tokenizer.encode_prompt(p) for p in PROMPTS]
    plain = _decoder(tiny_target, create_drafter("none", tiny_target.config), 1)
    reference = plain.generate(prompts, SamplingParams(), 30).sequences
    eos = reference[0].token_ids[4]
    for K in (4, 7):
        spec = SpeculativeDecoder(tiny_target.model, RandomDrafter(tiny_target.config.vocab_size), K, [eos])
        plain_eos = SpeculativeDecoder(tiny_target.model, create_drafter("none", tiny_target.config), 1, [eos])
        a = plain_eos.generate(prompts, SamplingParams(), 30).sequences
        b = spec.generate(prompts, SamplingParams(), 30).sequences
        assert a[0].token_ids == reference[0].token_ids[: reference[0].token_ids.index(eos) + 1]
        assert [s.token_ids for s in a] == [s.token_ids for s in b]
        assert b[0].finish_reason == "eos"


def test_stop_string_inside_a_block(tiny_target):
    prompts = [tiny_target.tokenizer.encode_prompt(PROMPTS[1])]
    plain = _decoder(tiny_target, create_drafter("none", tiny_target.config), 1)
    full = plain.generate(prompts, SamplingParams(), 30).sequences[0]
    text = tiny_target.tokenizer.decode(full.token_ids)
    stop = text[6:8]
    a = plain.generate(prompts, SamplingParams(), 30, stop=[stop]).sequences[0]
    b = _decoder(tiny_target, create_drafter("ngram", tiny_target.config), 7).generate(
        prompts, SamplingParams(), 30, stop=[stop]).sequences[0]
    assert a.token_ids == b.token_ids and b.finish_reason == "stop"
    assert stop in tiny_target.tokenizer.decode(b.token_ids)
    assert stop not in tiny_target.tokenizer.decode(b.token_ids[:-1])


def test_max_new_tokens_inside_a_block(tiny_target):
    prompts = [tiny_target.tokenizer.encode_prompt(PROMPTS[1])]
    out = _decoder(tiny_target, RandomDrafter(tiny_target.config.vocab_size), 7).generate(
        prompts, SamplingParams(), 10)
    assert len(out.sequences[0].token_ids) == 10 and out.sequences[0].finish_reason == "length"


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_batched_equals_one_by_one_when_sampling(tiny_target, kind):
    """Per-row generators make each row's draws independent of who else is in the batch; a row whose prompt
    came before takes a copy of that prefill (`DecodeStages.prefill_copy`), and with the same seed it emits
    what that row emits."""
    prompts = [tiny_target.tokenizer.encode_prompt(p) for p in PROMPTS]
    params = SamplingParams(temperature=0.8, top_p=0.9)
    decoder = _decoder(tiny_target, _make(kind, tiny_target), 4)
    batched = decoder.generate([*prompts, prompts[0], prompts[2]], params, 25, seeds=[11, 12, 13, 11, 13]).sequences
    singles = [decoder.generate([p], params, 25, seeds=[s]).sequences[0] for p, s in zip(prompts, [11, 12, 13])]
    assert [s.token_ids for s in batched] == [s.token_ids for s in singles + [singles[0], singles[2]]]


# The sampled-distribution test costs 4-15 s a kind here (its 4,000 rows share one prefill; 12-45 s when each
# ran its own). The ablations and the wrappers' second settings
# share every sampling path with a kind in the default suite; they and the costliest kinds (dels, dfly, dspark,
# dflash2: 23-45 s each; specblock, 35 s, whose sampled trees test_specblock.py and test_specblock_tree_verify.py
# also check in the default suite; peagle, 21 s, a chain drafter like hspec and dflash) run with `-m slow`, which
# CI runs too, so that the default suite stays under 15 minutes. Every kind is tested in one suite or the other.
ABLATIONS = ("hspec-kvreuse-only", "hspec-lasttoken-only", "hspec-nomarkov", "mamba-only", "attention-only",
             "dflash-kvreuse")
SAMPLED_IN_SLOW = (*ABLATIONS, "peagle+ngram", "hspec+ngram:0.1", "dflash:0.07", "random-test:0.05", "dels", "dfly",
                   "dspark", "dflash2", "hspec+ngram:auto", "dflash:auto", "ngram:auto", "dflash:tree", "specblock",
                   "peagle")


@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.slow) if k in SAMPLED_IN_SLOW else k
                                  for k in ALL_KINDS])
def test_sampled_output_has_target_distribution(vocab8_dir, kind):
    """Chi-square goodness of fit of 3-token continuations (4,000 samples, K = 2).

    Cells with expected count < 5 are pooled. The test fails when the p-value < 1e-4, so a correct
    implementation fails with probability 1e-4 per kind; the seeds are fixed, there are no reruns.
    """
    from conftest import assert_samples_follow, exact_joint, load_tiny

    target = load_tiny(vocab8_dir)
    params = SamplingParams(temperature=1.3, top_k=6)
    prompt = [1, 4, 5, 6, 3]
    exact = exact_joint(target, prompt, params, 3)
    N = 4000
    decoder = SpeculativeDecoder(target.model, _make(kind, target), 2, eos_token_ids=())
    out = decoder.generate([prompt] * N, params, 3, seeds=range(1000, 1000 + N))
    assert_samples_follow([tuple(s.token_ids) for s in out.sequences], exact)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "int8", "int4", "w4a8"])
def test_sampled_output_has_target_distribution_in_each_reduced_precision(vocab8_dir, dtype):
    """The chi-square test above for H-Spec on the tiny target in bf16, int8, int4 and w4a8: rejection sampling
    reads the verify's probabilities in the runtime's dtype, and the samples must follow that runtime's
    own distribution (enumerated in the same dtype)."""
    from conftest import assert_samples_follow, exact_joint, load_tiny

    target = load_tiny(vocab8_dir, dtype=dtype)
    params = SamplingParams(temperature=1.3, top_k=6)
    prompt = [1, 4, 5, 6, 3]
    exact = exact_joint(target, prompt, params, 3)
    N = 4000
    decoder = SpeculativeDecoder(target.model, _make("hspec", target), 2, eos_token_ids=())
    out = decoder.generate([prompt] * N, params, 3, seeds=range(1000, 1000 + N))
    assert_samples_follow([tuple(s.token_ids) for s in out.sequences], exact)


@pytest.mark.slow
@pytest.mark.parametrize("B,K", list(itertools.product([1, 3], [1, 4, 7])))
def test_greedy_equals_plain_on_smollm2(smollm2, B, K):
    prompts = [smollm2.tokenizer.encode_prompt(p) for p in
               ("Write a haiku about autumn.", "What is 12 times 13?", "List three primary colors.")[:B]]
    plain = _decoder(smollm2, create_drafter("none", smollm2.config), 1).generate(prompts, SamplingParams(), 48)
    spec = _decoder(smollm2, create_drafter("ngram", smollm2.config), K).generate(prompts, SamplingParams(), 48)
    assert [s.token_ids for s in spec.sequences] == [s.token_ids for s in plain.sequences]


@pytest.mark.slow
@pytest.mark.parametrize("kind,B,K", [("hspec", 1, 7), ("hspec", 3, 3), ("hspec+ngram", 1, 7), ("hspec+ngram", 3, 3),
                                      ("hspec+ngram:0.4", 1, 7), ("hspec+ngram:0.4", 3, 7), ("hspec:auto", 3, 7),
                                      ("hspec+ngram:auto", 3, 7)])
def test_shipped_hspec_drafter_is_lossless_on_smollm2(smollm2, kind, B, K):
    """The trained drafter the README's main command uses (alone, behind prompt lookup, verifying only its sure
    drafts, and with the length that pays, whether a row drafts decided by the outlook shipped with it, at costs
    where drafting often pays): greedy output equals plain decoding, and it drafts."""
    from hspec.runtime import build_drafter

    cheap = StepCost(draft=0.1, per_token=0.05, per_token_key=0.0)
    drafter = build_drafter(kind, smollm2, step_cost=cheap if kind.endswith(":auto") else None)
    if kind.endswith(":auto"):
        assert drafter.outlook is not None, "the shipped H-Spec drafter ships an outlook"
    prompts = [smollm2.tokenizer.encode_prompt(p) for p in
               ("Explain what a hash table is.", "Translate 'good morning' into French.", "Name two planets.")[:B]]
    plain = _decoder(smollm2, create_drafter("none", smollm2.config), 1).generate(prompts, SamplingParams(), 40)
    spec = _decoder(smollm2, drafter, K).generate(prompts, SamplingParams(), 40)
    assert [s.token_ids for s in spec.sequences] == [s.token_ids for s in plain.sequences]
    assert spec.metrics()["mean_accepted_length"] > 1.0


@pytest.mark.slow
@pytest.mark.parametrize("kind,B,K,dtype", [("ngram", 3, 7, "bfloat16"), ("hspec+ngram:0.4", 1, 7, "bfloat16"),
                                            ("hspec", 2, 7, "int8"), ("hspec+ngram", 2, 7, "int4"),
                                            ("hspec+ngram:0.4", 2, 7, "w4a8")])
def test_reduced_precision_greedy_equals_plain_on_smollm2(kind, B, K, dtype):
    """The real target in bfloat16 (what --dtype auto picks on AVX512-BF16/AMX CPUs), int8 and int4: greedy
    speculative output equals plain greedy output of the same dtype, token for token (the row-invariant
    kernels of models/layers.py)."""
    from hspec.models.loading import load_target
    from hspec.runtime import build_drafter

    target = load_target("smollm2", dtype=dtype)
    prompts = [target.tokenizer.encode_prompt(p) for p in
               ("Write a haiku about autumn.", "What is 12 times 13?", "List three primary colors.")[:B]]
    plain = _decoder(target, create_drafter("none", target.config), 1).generate(prompts, SamplingParams(), 48)
    spec = _decoder(target, build_drafter(kind, target), K).generate(prompts, SamplingParams(), 48)
    assert [s.token_ids for s in spec.sequences] == [s.token_ids for s in plain.sequences]


def test_metrics_name_the_decode_rate_apart_from_the_rate_with_prefill(tiny_target):
    out = _decoder(tiny_target, create_drafter("ngram", tiny_target.config), 3).generate(
        [tiny_target.tokenizer.encode_prompt(PROMPTS[0])], SamplingParams(), 12)
    m = out.metrics()
    assert "tokens_per_s" not in m  # one word, one measure
    assert m["decode_tokens_per_s"] == pytest.approx((out.num_new_tokens - 1) / out.decode_s)
    assert m["tokens_per_s_with_prefill"] == pytest.approx(out.num_new_tokens / (out.prefill_s + out.decode_s))


def test_metrics_of_a_run_that_drafted_nothing_have_no_mean_accepted_length(tiny_target):
    """A `:auto` row whose drafting never pays runs plain steps: no MAL to report (None, which JSON has), not NaN."""
    from hspec.runtime import build_drafter

    never_pays = StepCost(draft=50.0, per_token=1.0, per_token_key=0.0)
    drafter = build_drafter("ngram:auto", tiny_target, step_cost=never_pays)
    out = _decoder(tiny_target, drafter, 3).generate([tiny_target.tokenizer.encode_prompt(PROMPTS[1])],
                                                     SamplingParams(), 12)
    m = out.metrics()
    assert m["mean_accepted_length"] is None and m["drafted_share"] == 0.0
    assert all(a is None for a in m["acceptance_by_position"])
    json.loads(json.dumps(m, allow_nan=False))


def test_drafted_share_counts_the_rows_steps_that_drafted(tiny_target):
    out = _decoder(tiny_target, create_drafter("ngram", tiny_target.config), 3).generate(
        [tiny_target.tokenizer.encode_prompt(p) for p in PROMPTS[:2]], SamplingParams(), 12)
    row_steps = [n for s in out.sequences for n in s.num_drafted]
    assert 0 < out.metrics()["drafted_share"] == sum(n > 0 for n in row_steps) / len(row_steps)
