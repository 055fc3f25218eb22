"""Golden and property tests for the Mamba-2 reference scans and mixer (CPU, seconds)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from hspec.ssm import Mamba2Config, Mamba2Mixer, count_mixer_params, segsum, ssd_chunked, ssd_recurrent


def make_inputs(
    batch: int = 2,
    seqlen: int = 10,
    nheads: int = 4,
    headdim: int = 3,
    ngroups: int = 2,
    d_state: int = 5,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
    with_state: bool = False,
) -> dict[str, torch.Tensor | None]:
    """Random SSD inputs of modest magnitude, drawn from an explicit generator."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=dtype)

    return {
        "x": randn(batch, seqlen, nheads, headdim),
        # softplus(randn - 1) gives step sizes around 0.3, so decays are neither ~1 nor ~0.
        "dt": F.softplus(randn(batch, seqlen, nheads) - 1.0),
        "A": -torch.exp(randn(nheads) * 0.5),
        "B": randn(batch, seqlen, ngroups, d_state),
        "C": randn(batch, seqlen, ngroups, d_state),
        "initial_state": randn(batch, nheads, headdim, d_state) if with_state else None,
    }


def tiny_config(**overrides: object) -> Mamba2Config:
    """A mixer config small enough for CPU tests; chunk_size 4 makes T > 4 span several chunks."""
    base = {"d_model": 16, "nheads": 4, "headdim": 8, "d_state": 4, "ngroups": 2, "d_conv": 4}
    base["chunk_size"] = 4
    base.update(overrides)
    return Mamba2Config(**base)  # type: ignore[arg-type]


# ---------------------------------------------------------------- SSD: chunked vs recurrence


@pytest.mark.parametrize("seqlen, chunk_size", [(3, 4), (4, 4), (10, 4), (10, 64), (16, 16), (9, 1)])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_matches_recurrence_float64(seqlen: int, chunk_size: int, with_state: bool) -> None:
    inputs = make_inputs(seqlen=seqlen, with_state=with_state)
    y_ref, s_ref = ssd_recurrent(**inputs)
    y, s = ssd_chunked(**inputs, chunk_size=chunk_size)
    assert y.shape == y_ref.shape == (2, seqlen, 4, 3)
    assert s.shape == s_ref.shape == (2, 4, 3, 5)
    assert (y - y_ref).abs().max() <= 1e-10
    assert (s - s_ref).abs().max() <= 1e-10


@pytest.mark.parametrize("seqlen, chunk_size", [(7, 16), (10, 4)])
def test_chunked_matches_recurrence_float32(seqlen: int, chunk_size: int) -> None:
    # fp32 at the brief's tolerance, with the drafter's group layout (4 groups) and unit-scale inputs.
    inputs = make_inputs(seqlen=seqlen, nheads=8, ngroups=4, d_state=4, dtype=torch.float32, with_state=True)
    y_ref, s_ref = ssd_recurrent(**inputs)
    y, s = ssd_chunked(**inputs, chunk_size=chunk_size)
    assert y.dtype == torch.float32
    assert (y - y_ref).abs().max() <= 1e-5
    assert (s - s_ref).abs().max() <= 1e-5


def test_single_token_is_one_step() -> None:
    # T = 1 from state S: y = (exp(dt A) S + dt x Bᵀ) C, written out by hand for one group.
    inputs = make_inputs(batch=1, seqlen=1, nheads=2, ngroups=1, with_state=True)
    x, dt, A, B, C, s0 = (inputs[k] for k in ("x", "dt", "A", "B", "C", "initial_state"))
    state = torch.exp(dt[0, 0] * A)[:, None, None] * s0[0] + dt[0, 0][:, None, None] * (
        x[0, 0][:, :, None] * B[0, 0, 0][None, None, :]
    )
    expected = state @ C[0, 0, 0]  # (nheads, P)
    y, s = ssd_chunked(**inputs)
    assert torch.allclose(y[0, 0], expected, atol=1e-12)
    assert torch.allclose(s[0], state, atol=1e-12)


def test_groups_map_to_contiguous_heads() -> None:
    # With 4 heads and 2 groups, heads 0-1 read group 0 and heads 2-3 read group 1: equal to
    # running each half of the heads separately with its single group.
    inputs = make_inputs(nheads=4, ngroups=2, with_state=True)
    y, s = ssd_chunked(**inputs, chunk_size=4)
    for grp, heads in enumerate((slice(0, 2), slice(2, 4))):
        part = {
            "x": inputs["x"][:, :, heads],
            "dt": inputs["dt"][:, :, heads],
            "A": inputs["A"][heads],
            "B": inputs["B"][:, :, grp : grp + 1],
            "C": inputs["C"][:, :, grp : grp + 1],
            "initial_state": inputs["initial_state"][:, heads],
        }
        y_part, s_part = ssd_recurrent(**part)
        assert torch.allclose(y[:, :, heads], y_part, atol=1e-10)
        assert torch.allclose(s[:, heads], s_part, atol=1e-10)


def test_initial_state_changes_output() -> None:
    with_state = make_inputs(with_state=True)
    without = {**with_state, "initial_state": None}
    y0, _ = ssd_chunked(**without)
    y1, _ = ssd_chunked(**with_state)
    assert (y1 - y0).abs().max() > 1e-3
    # The state enters linearly: the difference is exactly the zero-input response of the state.
    zero_input = {**with_state, "x": torch.zeros_like(with_state["x"])}
    y_state_only, _ = ssd_chunked(**zero_input)
    assert torch.allclose(y1 - y0, y_state_only, atol=1e-10)


@pytest.mark.parametrize("split", [1, 4, 7])
@pytest.mark.parametrize("scan", [ssd_chunked, ssd_recurrent])
def test_split_sequence_carries_state(split: int, scan) -> None:
    inputs = make_inputs(seqlen=11, with_state=True)
    y_full, s_full = scan(**inputs)
    first = {k: v[:, :split] if k in ("x", "dt", "B", "C") else v for k, v in inputs.items()}
    second = {k: v[:, split:] if k in ("x", "dt", "B", "C") else v for k, v in inputs.items()}
    y1, s1 = scan(**first)
    y2, s2 = scan(**{**second, "initial_state": s1})
    assert torch.allclose(torch.cat([y1, y2], dim=1), y_full, atol=1e-10)
    assert torch.allclose(s2, s_full, atol=1e-10)


def test_chunked_gradients_match_recurrence() -> None:
    inputs = make_inputs(seqlen=6, with_state=True)
    leaves = {k: v.clone().requires_grad_() for k, v in inputs.items()}
    grads = []
    for scan in (ssd_recurrent, lambda **kw: ssd_chunked(**kw, chunk_size=4)):
        y, s = scan(**leaves)
        (y.pow(2).sum() + s.pow(2).sum()).backward()
        grads.append({k: v.grad.clone() for k, v in leaves.items()})
        for v in leaves.values():
            v.grad = None
    for k in leaves:
        assert torch.allclose(grads[0][k], grads[1][k], atol=1e-9), k
        assert torch.isfinite(grads[1][k]).all(), k


def test_segsum() -> None:
    a = torch.tensor([0.5, -1.0, -2.0, -0.25], dtype=torch.float64)
    out = segsum(a)
    for i in range(4):
        for j in range(4):
            expected = a[j + 1 : i + 1].sum() if i >= j else float("-inf")
            assert out[i, j] == expected


def test_ssd_rejects_bad_shapes() -> None:
    inputs = make_inputs()
    with pytest.raises(ValueError, match="dt must be"):
        ssd_chunked(**{**inputs, "dt": inputs["dt"][:, :-1]})
    with pytest.raises(ValueError, match="ngroups=3"):
        three_groups = inputs["B"][:, :, :1].expand(-1, -1, 3, -1)
        ssd_recurrent(**{**inputs, "B": three_groups, "C": three_groups})
    with pytest.raises(ValueError, match="initial_state"):
        ssd_chunked(**{**inputs, "initial_state": torch.zeros(2, 4, 3, 4, dtype=torch.float64)})
    with pytest.raises(ValueError, match="chunk_size"):
        ssd_chunked(**inputs, chunk_size=0)


# ---------------------------------------------------------------- mixer


def test_mixer_shapes_and_reference_scan() -> None:
    torch.manual_seed(0)
    cfg = tiny_config()
    mixer = Mamba2Mixer(cfg)
    hidden = torch.randn(3, 10, cfg.d_model)
    out, state = mixer(hidden)
    assert out.shape == (3, 10, cfg.d_model)
    assert state.shape == (3, cfg.nheads, cfg.headdim, cfg.d_state)
    assert torch.isfinite(out).all() and torch.isfinite(state).all()


def test_mixer_is_causal() -> None:
    # Changing token t must not change outputs before t (the conv and the scan look only backwards).
    torch.manual_seed(0)
    mixer = Mamba2Mixer(tiny_config()).double()
    hidden = torch.randn(1, 9, 16, dtype=torch.float64)
    out, _ = mixer(hidden)
    perturbed = hidden.clone()
    perturbed[:, 5] += 1.0
    out_p, _ = mixer(perturbed)
    assert torch.allclose(out[:, :5], out_p[:, :5], rtol=0.0, atol=1e-12)
    assert not torch.allclose(out[:, 5:], out_p[:, 5:])


def test_mixer_output_does_not_depend_on_chunk_size() -> None:
    # Three chunks of 4 (with padding) vs one chunk of 64: the chunking is an implementation detail.
    torch.manual_seed(0)
    cfg = tiny_config()
    mixer = Mamba2Mixer(cfg).double()
    hidden = torch.randn(2, 10, cfg.d_model, dtype=torch.float64)
    s0 = torch.randn(2, cfg.nheads, cfg.headdim, cfg.d_state, dtype=torch.float64)
    out, state = mixer(hidden, s0)
    reference = Mamba2Mixer(dataclasses.replace(cfg, chunk_size=64)).double()
    reference.load_state_dict(mixer.state_dict())
    out_ref, state_ref = reference(hidden, s0)
    assert torch.allclose(out, out_ref, atol=1e-10)
    assert torch.allclose(state, state_ref, atol=1e-10)


def test_mixer_gradients_reach_every_parameter() -> None:
    torch.manual_seed(0)
    mixer = Mamba2Mixer(tiny_config())
    hidden = torch.randn(2, 6, 16)
    s0 = torch.randn(2, 4, 8, 4, requires_grad=True)
    out, state = mixer(hidden, s0)
    (out.pow(2).mean() + state.pow(2).mean()).backward()
    for name, p in mixer.named_parameters():
        assert p.grad is not None, name
        assert p.grad.abs().sum() > 0, name
    # The injected state is trainable through the scan (H-Spec trains Proj_dS through it).
    assert s0.grad is not None and s0.grad.abs().sum() > 0


def test_mixer_initial_state_changes_output() -> None:
    torch.manual_seed(0)
    cfg = tiny_config()
    mixer = Mamba2Mixer(cfg)
    hidden = torch.randn(2, 5, cfg.d_model)
    out0, _ = mixer(hidden)
    out_zero, _ = mixer(hidden, torch.zeros(2, cfg.nheads, cfg.headdim, cfg.d_state))
    out1, _ = mixer(hidden, torch.randn(2, cfg.nheads, cfg.headdim, cfg.d_state))
    assert torch.allclose(out0, out_zero)
    assert (out1 - out0).abs().max() > 1e-3


@pytest.mark.parametrize(
    "sizes",
    [
        {"d_model": 16, "nheads": 4, "headdim": 8, "d_state": 4, "ngroups": 2, "d_conv": 4},
        {"d_model": 24, "nheads": 6, "headdim": 4, "d_state": 3, "ngroups": 3, "d_conv": 2},
        # The paper's Qwen3-4B drafter mixer: H = 2560, 44 heads of 64, d_inner 2816 > H.
        {"d_model": 2560, "nheads": 44, "headdim": 64, "d_state": 4, "ngroups": 4, "d_conv": 4},
    ],
)
def test_count_mixer_params_matches_module(sizes: dict[str, int]) -> None:
    mixer = Mamba2Mixer(Mamba2Config(**sizes), device="meta")
    assert count_mixer_params(**sizes) == sum(p.numel() for p in mixer.parameters())


def test_mixer_initialisation() -> None:
    torch.manual_seed(0)
    cfg = tiny_config(nheads=64, ngroups=4)
    mixer = Mamba2Mixer(cfg)
    minus_a = torch.exp(mixer.A_log)
    assert ((minus_a >= 1.0) & (minus_a <= 16.0)).all()
    dt = F.softplus(mixer.dt_bias)
    assert ((dt >= 1e-3 - 1e-7) & (dt <= 1e-1 + 1e-7)).all()
    assert torch.equal(mixer.D, torch.ones(cfg.nheads))


def test_mixer_rejects_bad_inputs() -> None:
    mixer = Mamba2Mixer(tiny_config())
    with pytest.raises(ValueError, match="hidden must be"):
        mixer(torch.randn(2, 5, 15))
    with pytest.raises(ValueError, match="initial_state must be"):
        mixer(torch.randn(2, 5, 16), torch.zeros(2, 4, 8, 5))


def test_kernel_path_refuses_cpu() -> None:
    mixer = Mamba2Mixer(tiny_config(use_kernel=True))
    with pytest.raises(RuntimeError, match="use_kernel"):
        mixer(torch.randn(1, 4, 16))


@pytest.mark.parametrize(
    "overrides, bad",
    [
        ({"nheads": 6, "ngroups": 4}, "nheads=6"),
        ({"nheads": 0}, "nheads"),
        ({"headdim": -1}, "-1"),
        ({"d_state": 2.5}, "2.5"),
        ({"d_conv": 0}, "d_conv"),
        ({"expand": 0}, "expand"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"dt_min": 0.2, "dt_max": 0.1}, "dt_min=0.2"),
        ({"a_init_min": 0.0}, "a_init_min=0.0"),
        ({"norm_eps": 0.0}, "norm_eps"),
    ],
)
def test_config_rejects_bad_values(overrides: dict[str, object], bad: str) -> None:
    with pytest.raises(ValueError, match=bad):
        tiny_config(**overrides)


def test_config_is_frozen_and_sizes_inner_by_heads() -> None:
    cfg = Mamba2Config(d_model=4096, nheads=56)  # the paper's Llama-3.1-8B drafter mixer
    assert cfg.d_inner == 56 * 64 and cfg.expand == 1
    assert cfg.conv_dim == 56 * 64 + 2 * 4 * 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.nheads = 8  # type: ignore[misc]


@pytest.mark.parametrize("seqlen", [1, 3, 7, 40])
def test_causal_depthwise_conv_equals_the_padded_conv1d(seqlen):
    from hspec.ssm.mixer import causal_depthwise_conv

    torch.manual_seed(seqlen)
    conv = torch.nn.Conv1d(12, 12, kernel_size=4, groups=12, padding=3, bias=True)
    x = torch.randn(3, seqlen, 12, requires_grad=True)
    reference = conv(x.transpose(1, 2))[..., :seqlen].transpose(1, 2)
    out = causal_depthwise_conv(x, conv.weight, conv.bias)
    assert torch.allclose(out, reference, atol=1e-6)
    grads = torch.autograd.grad(out.square().sum(), (x, conv.weight, conv.bias))
    expected = torch.autograd.grad(reference.square().sum(), (x, conv.weight, conv.bias))
    for got, want in zip(grads, expected):
        assert torch.allclose(got, want, atol=1e-5)
    changed = x.detach().clone()
    changed[:, -1] += 1.0  # the last position must not influence any earlier output
    assert torch.allclose(causal_depthwise_conv(changed, conv.weight, conv.bias)[:, :-1], out[:, :-1], atol=1e-6)
