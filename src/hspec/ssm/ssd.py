"""Reference Mamba-2 state-space duality (SSD) scans in plain PyTorch.

Two ways to compute the same selective scan (Dao & Gu, 2024, "Transformers are SSMs"):

* `ssd_recurrent` walks the sequence one token at a time. It is slow but obviously right, and is the
  golden reference the tests compare against.
* `ssd_chunked` is the parallel SSD form: inside a chunk the output is a masked, decay-weighted
  "attention" (the quadratic form); between chunks only the (P, N) states are passed on. The
  H-Spec drafter scans a block of K <= 16 positions, which fits in one chunk, so the whole block is
  evaluated in parallel starting from the injected state S_init (paper §3.3.1).

Shape legend: B batch, T tokens, N SSM state, P SSM head dim; `nheads` and `ngroups` are spelled
out. Head h reads B/C group h // (nheads // ngroups), as in the mamba_ssm Triton kernels.

Both functions compute in at least float32 (float64 inputs stay float64), return y in x's dtype and
the final state in that accumulation dtype, so a bf16 model still sees an fp32 state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["segsum", "ssd_chunked", "ssd_recurrent"]


def _check_inputs(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    initial_state: torch.Tensor | None,
) -> None:
    """Raise ValueError unless the SSD inputs have mutually consistent shapes."""
    if x.dim() != 4:
        raise ValueError(f"x must be (B, T, nheads, P), got shape {tuple(x.shape)}")
    batch, seqlen, nheads, headdim = x.shape
    if dt.shape != (batch, seqlen, nheads):
        raise ValueError(f"dt must be {(batch, seqlen, nheads)}, got shape {tuple(dt.shape)}")
    if A.shape != (nheads,):
        raise ValueError(f"A must be ({nheads},), got shape {tuple(A.shape)}")
    if B.dim() != 4 or B.shape[:2] != (batch, seqlen):
        raise ValueError(f"B must be ({batch}, {seqlen}, ngroups, N), got shape {tuple(B.shape)}")
    if C.shape != B.shape:
        raise ValueError(f"C must have B's shape {tuple(B.shape)}, got shape {tuple(C.shape)}")
    ngroups, d_state = B.shape[2], B.shape[3]
    if nheads % ngroups != 0:
        raise ValueError(f"nheads={nheads} must be divisible by ngroups={ngroups}")
    if initial_state is not None and initial_state.shape != (batch, nheads, headdim, d_state):
        raise ValueError(
            f"initial_state must be {(batch, nheads, headdim, d_state)}, "
            f"got shape {tuple(initial_state.shape)}"
        )


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the scan accumulates in: float32, or float64 when the inputs are float64."""
    return torch.promote_types(x.dtype, torch.float32)


def _heads_from_groups(t: torch.Tensor, nheads: int) -> torch.Tensor:
    """Broadcast (B, T, ngroups, N) to (B, T, nheads, N): head h reads group h // (nheads // ngroups)."""
    # repeat_interleave keeps the heads of one group contiguous, matching the kernel's head -> group map.
    return t.repeat_interleave(nheads // t.shape[2], dim=2)


def segsum(a: torch.Tensor) -> torch.Tensor:
    """Segment sums of per-step log-decays, masked to the causal lower triangle.

    Args:
        a: (..., L) log-decay of each step (dt * A, all <= 0).

    Returns:
        (..., L, L) with out[..., i, j] = a[j+1] + ... + a[i] for i >= j (0 on the diagonal) and
        -inf above it, so that exp(out) is the decay from step j to step i and is 0 for j > i.
    """
    length = a.shape[-1]
    # Summing a masked copy directly, rather than subtracting two cumulative sums
    # (cumsum[i] - cumsum[j]), avoids cancellation between large, nearly equal numbers.
    strict_lower = torch.ones(length, length, dtype=torch.bool, device=a.device).tril(-1)
    a_ij = a.unsqueeze(-1).expand(*a.shape, length)  # (..., L, L); [i, j] = a[i]
    seg = a_ij.masked_fill(~strict_lower, 0.0).cumsum(dim=-2)  # [i, j] = sum_{j < k <= i} a[k]
    lower = torch.ones(length, length, dtype=torch.bool, device=a.device).tril(0)
    return seg.masked_fill(~lower, float("-inf"))


def ssd_recurrent(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequential SSD scan, one token at a time (the reference).

    Per head h and step t:  S_t = exp(dt_t * A_h) * S_{t-1} + dt_t * outer(x_t, B_t),  y_t = S_t @ C_t.

    Args:
        x: (B, T, nheads, P) inputs.
        dt: (B, T, nheads) step sizes, already positive (softplus with bias applied by the caller).
        A: (nheads,) negative state decay rates.
        B: (B, T, ngroups, N) input projections.
        C: (B, T, ngroups, N) output projections.
        initial_state: (B, nheads, P, N) state before the first token; None means zeros.

    Returns:
        y: (B, T, nheads, P) in x's dtype, and the final state (B, nheads, P, N) after the last token.
    """
    _check_inputs(x, dt, A, B, C, initial_state)
    batch, seqlen, nheads, headdim = x.shape
    acc = _acc_dtype(x)
    x_, dt_, A_ = x.to(acc), dt.to(acc), A.to(acc)
    B_ = _heads_from_groups(B, nheads).to(acc)  # (B, T, nheads, N)
    C_ = _heads_from_groups(C, nheads).to(acc)  # (B, T, nheads, N)
    if initial_state is None:
        state = x_.new_zeros(batch, nheads, headdim, B.shape[-1])  # (B, nheads, P, N)
    else:
        state = initial_state.to(acc)  # (B, nheads, P, N)

    ys = []
    for t in range(seqlen):
        decay = torch.exp(dt_[:, t] * A_)  # (B, nheads)
        # dt * outer(x, B): the discretised input (zero-order hold on A, Euler on B, as in Mamba-2).
        inp = (dt_[:, t, :, None] * x_[:, t])[..., None] * B_[:, t, :, None, :]  # (B, nheads, P, N)
        state = decay[..., None, None] * state + inp  # (B, nheads, P, N)
        ys.append(torch.einsum("bhpn,bhn->bhp", state, C_[:, t]))  # (B, nheads, P)
    y = torch.stack(ys, dim=1) if ys else x_.new_zeros(batch, 0, nheads, headdim)  # (B, T, nheads, P)
    return y.to(x.dtype), state


def ssd_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Parallel (chunked) SSD scan; same arguments and results as `ssd_recurrent`.

    Inside each chunk of `chunk_size` tokens the output is the quadratic form
    y = (L ∘ C Bᵀ) (dt x) with L the causal decay mask; across chunks the per-chunk states are
    combined by a short recurrence over chunks. When T <= chunk_size there is a single chunk and
    the scan is fully parallel.

    Args:
        x: (B, T, nheads, P) inputs.
        dt: (B, T, nheads) positive step sizes.
        A: (nheads,) negative state decay rates.
        B: (B, T, ngroups, N) input projections.
        C: (B, T, ngroups, N) output projections.
        initial_state: (B, nheads, P, N) state before the first token; None means zeros.
        chunk_size: tokens per chunk (the quadratic block length).

    Returns:
        y: (B, T, nheads, P) in x's dtype, and the final state (B, nheads, P, N).
    """
    _check_inputs(x, dt, A, B, C, initial_state)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    batch, seqlen, nheads, headdim = x.shape
    d_state = B.shape[-1]
    acc = _acc_dtype(x)

    # 0. Pad T up to a multiple of the chunk length. Padded steps get dt = 0, so their decay is
    #    exp(0) = 1 and their input dt * x * B is 0: they leave the state untouched and the final
    #    state after the padding equals the state after the last real token.
    chunk = min(chunk_size, max(seqlen, 1))
    pad = (-seqlen) % chunk
    x_ = F.pad(x.to(acc), (0, 0, 0, 0, 0, pad))  # (B, T', nheads, P)
    dt_ = F.pad(dt.to(acc), (0, 0, 0, pad))  # (B, T', nheads)
    B_ = F.pad(_heads_from_groups(B, nheads).to(acc), (0, 0, 0, 0, 0, pad))  # (B, T', nheads, N)
    C_ = F.pad(_heads_from_groups(C, nheads).to(acc), (0, 0, 0, 0, 0, pad))  # (B, T', nheads, N)
    nchunks = x_.shape[1] // chunk

    # 1. Discretise: per-step log-decay dt * A and the dt-scaled input.
    log_decay = dt_ * A.to(acc)  # (B, T', nheads), <= 0
    x_dt = x_ * dt_[..., None]  # (B, T', nheads, P)

    # 2. Split the time axis into chunks (c chunks of l tokens; s also indexes tokens in a chunk).
    x_dt = x_dt.reshape(batch, nchunks, chunk, nheads, headdim)  # (B, c, l, nheads, P)
    B_ = B_.reshape(batch, nchunks, chunk, nheads, d_state)  # (B, c, l, nheads, N)
    C_ = C_.reshape(batch, nchunks, chunk, nheads, d_state)  # (B, c, l, nheads, N)
    log_decay = log_decay.reshape(batch, nchunks, chunk, nheads).permute(0, 3, 1, 2)  # (B, nheads, c, l)
    # Cumulative log-decay from the start of each chunk up to and including token l.
    cum = log_decay.cumsum(dim=-1)  # (B, nheads, c, l)

    # 3. Intra-chunk outputs (the diagonal blocks): a causal "attention" C_l · B_s weighted by the
    #    decay from token s to token l, applied to dt * x. This is the quadratic half of the duality.
    decay_ls = torch.exp(segsum(log_decay))  # (B, nheads, c, l, l)
    scores = torch.einsum("bclhn,bcshn->bhcls", C_, B_)  # (B, nheads, c, l, l)
    y_diag = torch.einsum("bhcls,bcshp->bclhp", scores * decay_ls, x_dt)  # (B, c, l, nheads, P)

    # 4. Each chunk's own contribution to the state at its end (as if it started from zero):
    #    every token's outer(dt x, B) decayed from its position to the chunk's last token.
    decay_to_end = torch.exp(cum[..., -1:] - cum)  # (B, nheads, c, l)
    chunk_states = torch.einsum("bclhn,bhcl,bclhp->bchpn", B_, decay_to_end, x_dt)  # (B, c, nheads, P, N)

    # 5. Inter-chunk recurrence: the state entering chunk z is the initial state and all earlier
    #    chunks' contributions, each decayed by the total decay of the chunks in between. With few
    #    chunks this is itself a small masked matrix product over the chunk axis.
    if initial_state is None:
        init = x_dt.new_zeros(batch, 1, nheads, headdim, d_state)  # (B, 1, nheads, P, N)
    else:
        init = initial_state.to(acc)[:, None]  # (B, 1, nheads, P, N)
    states = torch.cat([init, chunk_states], dim=1)  # (B, c+1, nheads, P, N)
    chunk_log_decay = F.pad(cum[..., -1], (1, 0))  # (B, nheads, c+1); slot 0 is the initial state
    decay_zc = torch.exp(segsum(chunk_log_decay))  # (B, nheads, c+1, c+1)
    states = torch.einsum("bhzc,bchpn->bzhpn", decay_zc, states)  # (B, c+1, nheads, P, N)
    # Entry z < c is the state entering chunk z; the last entry is the state after every chunk.
    states_in, final_state = states[:, :-1], states[:, -1]

    # 6. Inter-chunk outputs (the off-diagonal blocks): read the state entering the chunk with C,
    #    decayed from the chunk's start to each token.
    decay_from_start = torch.exp(cum)  # (B, nheads, c, l)
    y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", C_, states_in, decay_from_start)  # (B, c, l, nheads, P)

    # 7. Sum both parts, merge chunks back into time and drop the padding.
    y = (y_diag + y_off).reshape(batch, nchunks * chunk, nheads, headdim)[:, :seqlen]  # (B, T, nheads, P)
    return y.to(x.dtype), final_state
