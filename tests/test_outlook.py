"""The outlook (hspec.drafters.outlook): fitted from hidden states to how far drafts are accepted, it decides
before drafting whether a `KIND:auto` row drafts. Greedy and sampled losslessness with an outlook are in
test_generate.py ("hspec:auto+outlook")."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from hspec.decoding.generate import SpeculativeDecoder
from hspec.drafters import create_drafter
from hspec.drafters.cost_aware import CostAwareDrafter
from hspec.drafters.outlook import OUTLOOK_FILE, Outlook, fit_outlook, load_outlook
from hspec.drafters.step_cost import StepCost
from hspec.drafters.wrapping import WrappingDrafter
from hspec.sampling import SamplingParams

K = 4
COST = StepCost(draft=0.02, per_token=0.05, per_token_key=0.0)
# the same with a draft that grows with the positions drafted: a row drafts the length its outlook expects to pay
BY_POSITION = StepCost(draft=0.02, per_token=0.05, per_token_key=0.0, draft_per_position=0.05)


def _synthetic(n: int = 3000, features: int = 6, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Features whose first column sets how many of K drafts are accepted (with noise); the rest is noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((n, features), generator=g) * torch.tensor([1.0] + [3.0] * (features - 1))
    accepted = (x[:, 0] * 1.5 + 1.5 + 0.5 * torch.randn(n, generator=g)).round().clamp(0, K).long()
    return x, accepted


def test_a_fitted_outlook_ranks_positions_by_how_far_their_drafts_go():
    x, accepted = _synthetic()
    outlook = fit_outlook(x, accepted, K, layers=(1, 2), l2=0.01)
    test_x, test_accepted = _synthetic(seed=1)
    s1 = torch.tensor([outlook.survival(h)[0] for h in test_x])
    positive, negative = s1[test_accepted >= 1], s1[test_accepted == 0]
    assert (positive[:, None] > negative[None, :]).float().mean() > 0.9  # AUC
    for h in test_x[:50]:
        s = outlook.survival(h)
        assert all(a >= b for a, b in zip(s, s[1:])), "S_k must not grow with k"
        assert all(0.0 <= a <= 1.0 for a in outlook.estimates(h))
    mean_s = torch.tensor([outlook.survival(h) for h in x]).mean(0)
    share = torch.stack([(accepted >= k).float().mean() for k in range(1, K + 1)])
    assert torch.allclose(mean_s, share, atol=0.03), "a fitted outlook is calibrated on its own data on average"


def test_an_outlook_survives_saving_and_loading(tmp_path):
    x, accepted = _synthetic(500)
    outlook = fit_outlook(x, accepted, K, layers=(3, 5), l2=0.1)
    outlook.save(tmp_path / OUTLOOK_FILE, {"fitted_on": "synthetic"})
    back = load_outlook(tmp_path)
    assert back.layers == (3, 5) and back.margin == outlook.margin
    assert torch.equal(back.weight, outlook.weight) and torch.equal(back.bias, outlook.bias)
    assert load_outlook(tmp_path / "elsewhere") is None
    save_file({"weight": torch.zeros(2, 2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not an outlook file"):
        Outlook.load(tmp_path / "other.safetensors")


def test_bad_outlooks_and_inputs_are_refused_with_their_shapes():
    with pytest.raises(ValueError, match=r"weight \(K, F\) and bias \(K,\), got \(3,\) and \(3,\)"):
        Outlook(torch.zeros(3), torch.zeros(3), (1,))
    with pytest.raises(ValueError, match="margin must be >= 1.*got 0"):
        Outlook(torch.zeros(2, 4), torch.zeros(2), (1,), margin=0)
    with pytest.raises(ValueError, match="reads 4 features .* got 6"):
        Outlook(torch.zeros(2, 4), torch.zeros(2), (1,)).survival(torch.zeros(6))
    with pytest.raises(ValueError, match=r"features \(N, F\) and accepted \(N,\), got \(5, 2\) and \(4,\)"):
        fit_outlook(torch.zeros(5, 2), torch.zeros(4), K, (1,))


class _Counting(WrappingDrafter):
    """The wrapped drafter, counting the rows it proposes for."""

    def __init__(self, model) -> None:
        super().__init__(model)
        self.rows = 0
        self.asked: list[int] = []  # the positions each call was asked for

    def propose(self, batch, K):
        self.rows += len(batch.seq_ids)
        self.asked.append(K)
        return self.model.propose(batch, K)


def _outlook(drafter, hidden_size: int, bias: float, scale: float = 0.0, seed: int = 0) -> Outlook:
    features = len(drafter.target_layers) * hidden_size
    weight = torch.randn((K, features), generator=torch.Generator().manual_seed(seed)) * scale / features ** 0.5
    return Outlook(weight, torch.full((K,), bias), tuple(drafter.target_layers))


def _run(target, drafter, prompts, max_new_tokens=24):
    decoder = SpeculativeDecoder(target.model, drafter, K, eos_token_ids=())
    return decoder.generate(prompts, SamplingParams(), max_new_tokens).sequences


def test_an_outlook_from_other_layers_is_refused(tiny_target):
    hspec = create_drafter("hspec", tiny_target.config, target_model=tiny_target.model)
    wrong = Outlook(torch.zeros(K, 4), torch.zeros(K), (99,))
    with pytest.raises(ValueError, match=r"outlook reads target layers \[99\]"):
        CostAwareDrafter(hspec, tiny_target.config.vocab_size, COST, outlook=wrong)


def test_the_outlook_decides_whether_a_row_drafts(tiny_target):
    torch.manual_seed(0)
    hspec = _Counting(create_drafter("hspec", tiny_target.config, target_model=tiny_target.model))
    prompts = [tiny_target.tokenizer.encode_prompt(p) for p in ("one two three", "a b c d e", "hello")]
    plain = _run(tiny_target, create_drafter("none", tiny_target.config), prompts)
    hidden = tiny_target.config.hidden_size
    never = CostAwareDrafter(hspec, tiny_target.config.vocab_size, COST, outlook=_outlook(hspec, hidden, -20.0))
    out = _run(tiny_target, never, prompts)
    assert hspec.rows == 0 and all(set(s.num_drafted) == {0} for s in out)
    assert [s.token_ids for s in out] == [s.token_ids for s in plain]
    always = CostAwareDrafter(hspec, tiny_target.config.vocab_size, COST, outlook=_outlook(hspec, hidden, 20.0))
    out = _run(tiny_target, always, prompts)
    assert hspec.rows == sum(len(s.num_drafted) for s in out), "a sure outlook drafts on every step of every row"
    assert [s.token_ids for s in out] == [s.token_ids for s in plain]


@pytest.mark.parametrize("cost", [COST, BY_POSITION], ids=["whole draft", "draft by position"])
def test_a_row_drafts_by_its_own_outlook_whatever_its_batch(tiny_target, cost):
    torch.manual_seed(0)
    hspec = create_drafter("hspec", tiny_target.config, target_model=tiny_target.model)
    outlook = _outlook(hspec, tiny_target.config.hidden_size, bias=-2.0, scale=6.0)
    prompts = [tiny_target.tokenizer.encode_prompt(p) for p in ("one two three", "a b c d e", "hello world")]
    together = _run(tiny_target, CostAwareDrafter(hspec, tiny_target.config.vocab_size, cost, outlook=outlook),
                    prompts)
    lengths = [d for s in together for d in s.num_drafted]
    assert 0 in lengths and max(lengths) > 0, "this outlook should let some steps draft and keep others plain"
    for prompt, row in zip(prompts, together):
        alone = _run(tiny_target, CostAwareDrafter(hspec, tiny_target.config.vocab_size, cost, outlook=outlook),
                     [prompt])[0]
        assert alone.num_drafted == row.num_drafted and alone.token_ids == row.token_ids


def test_a_row_drafts_only_the_positions_its_outlook_expects_to_pay_where_each_position_costs(tiny_target):
    """With a draft that grows per position the model is asked for the outlook's best length (under K on some
    steps) and no more is verified; with a draft that costs the same at any length it is asked for all K."""
    from hspec.drafters.cost_aware import outlook_length

    torch.manual_seed(0)
    hspec = _Counting(create_drafter("hspec", tiny_target.config, target_model=tiny_target.model))
    outlook = _outlook(hspec, tiny_target.config.hidden_size, bias=-2.0, scale=6.0)
    prompts = [[tiny_target.tokenizer.encode_prompt(p)] for p in ("one two three", "a b c d e", "hello world")]
    expected, drafted = [], []
    for prompt in prompts:  # one row at a time: each call of the model is that row's
        plain = _run(tiny_target, create_drafter("none", tiny_target.config), prompt)[0]
        drafter = CostAwareDrafter(hspec, tiny_target.config.vocab_size, BY_POSITION, outlook=outlook)
        original = drafter.propose

        def propose(batch, K, drafter=drafter, original=original):  # the outlook's length before the step
            state = drafter._state(batch.seq_ids[0])
            if state.outlook is not None:
                expected.append(outlook_length(state.outlook[:K], batch.pool.length(batch.seq_ids[0]), BY_POSITION))
            return original(batch, K)

        drafter.propose = propose
        row = _run(tiny_target, drafter, prompt)[0]
        assert row.token_ids == plain.token_ids
        drafted += [d for d in row.num_drafted if d > 0]
    assert hspec.asked == [m for m in expected if m > 0], "the model drafts the outlook's length, where it drafts"
    assert min(hspec.asked) < K <= max(hspec.asked), "this outlook should ask for fewer than K on some steps"
    assert all(d <= m for d, m in zip(drafted, hspec.asked, strict=True))
    hspec.asked.clear()
    _run(tiny_target, CostAwareDrafter(hspec, tiny_target.config.vocab_size, COST, outlook=outlook), prompts[0])
    assert set(hspec.asked) == {K}


def test_build_drafter_takes_the_outlook_beside_the_checkpoint(tmp_path, tiny_target):
    from hspec.drafters.checkpoint import save_drafter
    from hspec.runtime import build_drafter

    torch.manual_seed(0)
    hspec = create_drafter("hspec", tiny_target.config, target_model=tiny_target.model)
    save_drafter(hspec, tmp_path, "tiny")
    without = build_drafter("hspec:auto", tiny_target, path=tmp_path, step_cost=COST)
    assert without.outlook is None
    _outlook(hspec, tiny_target.config.hidden_size, 0.0).save(tmp_path / OUTLOOK_FILE)
    for kind in ("hspec:auto", "hspec+ngram:auto"):
        assert build_drafter(kind, tiny_target, path=tmp_path, step_cost=COST).outlook.layers == hspec.target_layers
    assert build_drafter("ngram:auto", tiny_target, step_cost=COST).outlook is None


class _Committed(CostAwareDrafter):
    """A `KIND:auto` drafter that also keeps, at each commit, the committed context's length and the hidden
    states of its last token: what the outlook reads at the next step."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[int, torch.Tensor]] = []

    def commit(self, pool, seq_ids, hidden, num_committed):
        last = int(num_committed[0]) - 1
        self.seen.append((pool.length(seq_ids[0]), hidden[0, last].float().clone()))
        super().commit(pool, seq_ids, hidden, num_committed)


@pytest.mark.parametrize("dtype", ["bfloat16", "w4a8"])
def test_fit_outlooks_features_are_the_hidden_states_decoding_commits(tiny_dirs, dtype):
    """scripts/fit_outlook.py fits on features of recorded answers; in the dtypes whose products give a row the
    same bits in a block of any size, they must be the bits decoding hands the outlook at every step, drafted
    or not."""
    from conftest import load_script, load_tiny

    target = load_tiny(tiny_dirs["llama"], dtype=dtype)
    torch.manual_seed(0)
    hspec = create_drafter("hspec", target.config, target_model=target.model)
    drafter = _Committed(hspec, target.config.vocab_size, COST,
                         outlook=_outlook(hspec, target.config.hidden_size, bias=-2.0, scale=6.0))
    prompt = target.tokenizer.encode_prompt("one two three four")
    answer = _run(target, drafter, [prompt], max_new_tokens=30)[0]
    assert 0 < sum(n > 0 for n in answer.num_drafted) < len(answer.num_drafted), "steps of both kinds"
    tokens = answer.token_ids
    features = load_script("fit_outlook").features_of(target, hspec.target_layers, prompt,
                                                      {"steps": tokens, "tokens": tokens})
    assert len(drafter.seen) == len(answer.num_drafted) + 1  # the prefill and every step
    for length, hidden in drafter.seen:
        assert torch.equal(features[length - len(prompt)], hidden.flatten()), f"context length {length}"


@pytest.mark.parametrize("features", [1, 7, 8, 9, 2880])
def test_the_outlooks_kernel_computes_the_survival_torch_does(features):
    """`hspec::outlook_survival` (models/cpu_kernels.cpp), what `Outlook.survival` takes where hspec's kernels are
    loaded: torch's value to fp32 rounding, and the same bits from bf16 hidden states as from their fp32 copy
    (an outlook is fitted on the fp32 copies of decoding's bf16 ones)."""
    from hspec.models.native import load_kernels

    if not load_kernels():
        pytest.skip("hspec's CPU kernels do not run here")
    gen = torch.Generator().manual_seed(features)
    weight, bias = torch.randn((K, features), generator=gen) / features ** 0.5, torch.randn(K, generator=gen)
    hidden = torch.randn(features, generator=gen).bfloat16()
    kernel = torch.ops.hspec.outlook_survival(hidden, weight, bias)
    assert torch.equal(kernel, torch.ops.hspec.outlook_survival(hidden.float(), weight, bias))
    torch.testing.assert_close(kernel, torch.addmv(bias, weight, hidden.float()).sigmoid(), rtol=1e-5, atol=1e-6)
    outlook = Outlook(weight, bias, (0,))
    survival = outlook.survival(hidden)
    assert survival == [min(kernel.tolist()[: k + 1]) for k in range(K)]
    with pytest.raises(RuntimeError, match=f"the weight reads {features} features, the hidden states hold"):
        torch.ops.hspec.outlook_survival(torch.zeros(features + 1), weight, bias)


def test_greedy_and_sampled_rows_drafting_different_lengths_in_one_batch_emit_what_each_does_alone(tiny_target):
    """Rows drafting different lengths are proposed in one call per length, and a greedy row's one-hot drafts sit
    beside a sampled row's distributions in one proposal: each row's output is still its own."""
    torch.manual_seed(0)
    hspec = create_drafter("hspec", tiny_target.config, target_model=tiny_target.model)
    outlook = _outlook(hspec, tiny_target.config.hidden_size, bias=-2.0, scale=6.0)
    prompts = [tiny_target.tokenizer.encode_prompt(p) for p in ("one two three", "a b c d e", "hello world")]
    params = [SamplingParams(), SamplingParams(temperature=0.8), SamplingParams()]

    def run(rows, seeds):
        drafter = CostAwareDrafter(hspec, tiny_target.config.vocab_size, BY_POSITION, outlook=outlook)
        decoder = SpeculativeDecoder(tiny_target.model, drafter, K, eos_token_ids=())
        return decoder.generate([prompts[r] for r in rows], [params[r] for r in rows], 24, seeds=seeds).sequences

    together = run([0, 1, 2], [5, 6, 7])
    for row, seed in zip(range(3), [5, 6, 7]):
        alone = run([row], [seed])[0]
        assert alone.token_ids == together[row].token_ids and alone.num_drafted == together[row].num_drafted
