"""The Mamba-2 mixer used by the H-Spec drafter (paper §3.3.1, App. B.1), in plain PyTorch.

    hidden --in_proj--> [z, x, B, C, dt]
    [x, B, C] --causal depthwise conv (zero start) + SiLU--> x, B, C
    y, S_T = SSD(x, softplus(dt + dt_bias), A = -exp(A_log), B, C, S_init) + D * x
    out = out_proj(RMSNorm(y * SiLU(z)))

The layer takes and returns its SSM state: `out, state = mixer(hidden, initial_state)`. In the drafter
the initial state is S_init, projected from the target's last-token hidden states; the conv always
starts from zeros because every draft block is a fresh sequence (docs/design.md#h-spec), so no conv state is
carried. Parameter layout and initialisation follow mamba_ssm's `Mamba2` module so that weights can
be compared with (or ported from) it, with one difference in sizing described on `Mamba2Config`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hspec.ssm.ssd import ssd_chunked

__all__ = ["GatedRMSNorm", "Mamba2Config", "Mamba2Mixer", "count_mixer_params"]


@dataclass(frozen=True)
class Mamba2Config:
    """Sizes and initialisation of one Mamba-2 mixer. Defaults are the paper's (App. B.1).

    The inner (SSM) width is d_inner = nheads * headdim. The paper fixes headdim = 64 and picks
    nheads per target to match a parameter budget (44 / 48 / 56 heads for Qwen3-4B / Qwen3-8B /
    Llama-3.1-8B), so d_inner generally differs from expand * d_model (e.g. 56 * 64 = 3584 while
    d_model = 4096). `expand` is therefore recorded for the paper's configuration table only and
    sizes nothing.
    """

    d_model: int  # H: width of the residual stream the mixer reads and writes
    nheads: int  # number of SSM heads; d_inner = nheads * headdim
    headdim: int = 64  # P: channels per SSM head
    d_state: int = 4  # N: SSM state size per channel
    ngroups: int = 4  # B/C groups; heads share B and C within a group (like GQA)
    d_conv: int = 4  # kernel width of the causal depthwise convolution
    expand: int = 1  # informational only (see class docstring); d_inner = nheads * headdim
    chunk_size: int = 64  # SSD chunk length; the drafter's K <= 16 block is one chunk
    dt_min: float = 1e-3  # lower end of the log-uniform initial step size dt
    dt_max: float = 1e-1  # upper end of the log-uniform initial step size dt
    a_init_min: float = 1.0  # lower end of the uniform initial decay rate -A
    a_init_max: float = 16.0  # upper end of the uniform initial decay rate -A
    norm_eps: float = 1e-5  # epsilon of the gated RMSNorm
    use_kernel: bool = False  # run the scan with mamba_ssm's Triton kernel (CUDA only, no fallback)

    def __post_init__(self) -> None:
        for name in ("d_model", "nheads", "headdim", "d_state", "ngroups", "d_conv", "expand", "chunk_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.nheads % self.ngroups != 0:
            raise ValueError(f"nheads={self.nheads} must be divisible by ngroups={self.ngroups}")
        if not 0.0 < self.dt_min <= self.dt_max:
            raise ValueError(f"need 0 < dt_min <= dt_max, got dt_min={self.dt_min}, dt_max={self.dt_max}")
        if not 0.0 < self.a_init_min <= self.a_init_max:
            raise ValueError(
                f"need 0 < a_init_min <= a_init_max, got a_init_min={self.a_init_min}, "
                f"a_init_max={self.a_init_max}"
            )
        if not self.norm_eps > 0.0:
            raise ValueError(f"norm_eps must be > 0, got {self.norm_eps}")

    @property
    def d_inner(self) -> int:
        """Width of the SSM branch (and of the gate z): nheads * headdim."""
        return self.nheads * self.headdim

    @property
    def conv_dim(self) -> int:
        """Channels the causal conv sees: x plus one B and one C per group."""
        return self.d_inner + 2 * self.ngroups * self.d_state


def count_mixer_params(
    d_model: int, nheads: int, headdim: int, d_state: int, ngroups: int, d_conv: int
) -> int:
    """Number of parameters of a `Mamba2Mixer` with these sizes, without building it.

    Lets a drafter choose `nheads` to match a parameter budget (the paper keeps H-Spec within 3% of
    DSpark's trainable parameters by varying only the head count).
    """
    d_inner = nheads * headdim
    conv_dim = d_inner + 2 * ngroups * d_state
    in_proj = d_model * (2 * d_inner + 2 * ngroups * d_state + nheads)  # z, x, B, C, dt; no bias
    conv = conv_dim * d_conv + conv_dim  # depthwise weights + bias
    per_head = 3 * nheads  # A_log, dt_bias, D
    norm = d_inner  # gated RMSNorm weight
    out_proj = d_inner * d_model  # no bias
    return in_proj + conv + per_head + norm + out_proj


class GatedRMSNorm(nn.Module):
    """RMSNorm(y * SiLU(z)) * weight, normalised separately within each of `ngroups` channel groups.

    Gating before the norm is mamba_ssm's `norm_before_gate=False`; normalising per group (each group
    holds the heads that share B and C) matches its `Mamba2` module, so the result does not depend on
    how heads are split across devices.
    """

    def __init__(
        self,
        dim: int,
        ngroups: int,
        eps: float,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if dim % ngroups != 0:
            raise ValueError(f"dim={dim} must be divisible by ngroups={ngroups}")
        self.ngroups = ngroups
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Gate y with SiLU(z), then RMS-normalise per group; y, z and the result are (B, T, d_inner)."""
        gated = (y.float() * F.silu(z.float())).unflatten(-1, (self.ngroups, -1))  # (B, T, G, d_inner/G)
        # The mean square is taken in fp32 so a bf16 model does not lose the small-norm channels.
        normed = gated * torch.rsqrt(gated.pow(2).mean(dim=-1, keepdim=True) + self.eps)  # (B, T, G, d/G)
        return normed.flatten(-2).to(y.dtype) * self.weight  # (B, T, d_inner)


class Mamba2Mixer(nn.Module):
    """One Mamba-2 mixer: `out, final_state = mixer(hidden, initial_state)`.

    Args:
        config: sizes and initialisation.
        device, dtype: where and how to allocate the parameters.
    """

    def __init__(
        self,
        config: Mamba2Config,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        cfg = config
        factory = {"device": device, "dtype": dtype}
        # One projection for all five branches, in mamba_ssm's order [z, x, B, C, dt].
        self.in_proj = nn.Linear(
            cfg.d_model, 2 * cfg.d_inner + 2 * cfg.ngroups * cfg.d_state + cfg.nheads, bias=False, **factory
        )
        # Depthwise (groups = channels) so each channel mixes only with its own past d_conv - 1 values;
        # left padding of d_conv - 1 zeros is the zero conv state every block starts from. The module
        # holds the weights (mamba_ssm's names and shapes); `causal_depthwise_conv` applies them.
        self.conv1d = nn.Conv1d(
            cfg.conv_dim,
            cfg.conv_dim,
            kernel_size=cfg.d_conv,
            groups=cfg.conv_dim,
            padding=cfg.d_conv - 1,
            bias=True,
            **factory,
        )
        # Per-head SSM parameters; their values are set in reset_ssm_parameters.
        self.A_log = nn.Parameter(torch.empty(cfg.nheads, **factory))
        self.dt_bias = nn.Parameter(torch.empty(cfg.nheads, **factory))
        self.D = nn.Parameter(torch.empty(cfg.nheads, **factory))
        # Mamba practice: no weight decay on these (they encode time scales, not features).
        for p in (self.A_log, self.dt_bias, self.D):
            p._no_weight_decay = True  # type: ignore[attr-defined]
        self.norm = GatedRMSNorm(cfg.d_inner, cfg.ngroups, cfg.norm_eps, **factory)
        self.out_proj = nn.Linear(cfg.d_inner, cfg.d_model, bias=False, **factory)
        self.reset_ssm_parameters()

    @torch.no_grad()
    def reset_ssm_parameters(self) -> None:
        """Mamba-2 initialisation of A_log, dt_bias and D (the linear and conv layers keep torch's)."""
        cfg = self.config
        # -A ~ U[a_init_min, a_init_max], stored as a log so A = -exp(A_log) stays negative.
        a = torch.empty(cfg.nheads, device=self.A_log.device, dtype=torch.float32)
        a.uniform_(cfg.a_init_min, cfg.a_init_max)
        self.A_log.copy_(torch.log(a))
        # dt ~ log-uniform in [dt_min, dt_max] (floored at 1e-4 as in mamba_ssm), stored as the inverse
        # of softplus so that softplus(0 + dt_bias) = dt at initialisation.
        u = torch.rand(cfg.nheads, device=self.dt_bias.device, dtype=torch.float32)
        dt = torch.exp(u * (math.log(cfg.dt_max) - math.log(cfg.dt_min)) + math.log(cfg.dt_min))
        dt = dt.clamp(min=1e-4)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus⁻¹(dt) = dt + log(1 - e^-dt)
        # D = 1: the skip connection initially passes x through unchanged.
        self.D.fill_(1.0)

    def forward(
        self, hidden: torch.Tensor, initial_state: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mix a sequence, starting the SSM from `initial_state` and the conv from zeros.

        Args:
            hidden: (B, T, H) input.
            initial_state: (B, nheads, P, N) SSM state before the first token; None means zeros.

        Returns:
            out: (B, T, H), and the SSM state (B, nheads, P, N) after the last token (fp32 or wider).
        """
        cfg = self.config
        if hidden.dim() != 3 or hidden.shape[-1] != cfg.d_model:
            raise ValueError(f"hidden must be (B, T, {cfg.d_model}), got shape {tuple(hidden.shape)}")
        bsz, seqlen, _ = hidden.shape
        state_shape = (bsz, cfg.nheads, cfg.headdim, cfg.d_state)
        if initial_state is not None and initial_state.shape != state_shape:
            raise ValueError(f"initial_state must be {state_shape}, got shape {tuple(initial_state.shape)}")

        # 1. Project into the gate z, the conv input [x, B, C] and the raw step size dt.
        zxbcdt = self.in_proj(hidden)  # (B, T, 2*d_inner + 2*G*N + nheads)
        z, xbc, dt_raw = zxbcdt.split([cfg.d_inner, cfg.conv_dim, cfg.nheads], dim=-1)

        # 2. Causal depthwise conv over time: position t sees only positions <= t.
        xbc = causal_depthwise_conv(xbc, self.conv1d.weight, self.conv1d.bias)  # (B, T, conv_dim)
        xbc = F.silu(xbc)
        x, B, C = xbc.split([cfg.d_inner, cfg.ngroups * cfg.d_state, cfg.ngroups * cfg.d_state], dim=-1)
        x = x.unflatten(-1, (cfg.nheads, cfg.headdim))  # (B, T, nheads, P)
        B = B.unflatten(-1, (cfg.ngroups, cfg.d_state))  # (B, T, G, N)
        C = C.unflatten(-1, (cfg.ngroups, cfg.d_state))  # (B, T, G, N)

        # 3. Discretisation parameters in fp32: in half precision exp(A_log) or softplus can lose
        #    the small step sizes that set long time scales.
        A = -torch.exp(self.A_log.float())  # (nheads,)
        dt = F.softplus(dt_raw.float() + self.dt_bias.float())  # (B, T, nheads)

        # 4. The selective scan from the injected state, plus the D skip connection.
        if cfg.use_kernel:
            y, final_state = _kernel_scan(x, dt, A, B, C, initial_state, cfg.chunk_size)
        else:
            y, final_state = ssd_chunked(x, dt, A, B, C, initial_state, chunk_size=cfg.chunk_size)
        y = y + self.D.to(y.dtype)[:, None] * x  # (B, T, nheads, P)

        # 5. Gate, normalise and project back to the residual width.
        y = self.norm(y.flatten(-2), z)  # (B, T, d_inner)
        return self.out_proj(y), final_state  # (B, T, H), (B, nheads, P, N)


def causal_depthwise_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`nn.Conv1d(C, C, W, groups=C, padding=W-1)` over time, first T outputs, in (B, T, C) layout.

    x (B, T, C); weight (C, 1, W); bias (C,) or None. out[t] = bias + sum_j weight[:, 0, j] * x[t - W + 1 + j]
    with zeros before the first position (the zero conv state every block starts from). Written as W
    shifted multiply-adds: for the short blocks a drafter mixes (T = K) this is several times faster
    than a convolution call on CPU, forward and backward, and needs no transposes.
    """
    width = weight.shape[-1]
    seqlen = x.shape[1]
    padded = F.pad(x, (0, 0, width - 1, 0))  # (B, T + W - 1, C)
    taps = weight[:, 0].to(x.dtype)  # (C, W)
    out = padded[:, :seqlen] * taps[:, 0]
    for j in range(1, width):
        out = out + padded[:, j:j + seqlen] * taps[:, j]
    return out if bias is None else out + bias.to(x.dtype)


def _kernel_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    initial_state: torch.Tensor | None,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ssd_chunked` computed by mamba_ssm's fused Triton kernel; same shapes and meaning.

    Raises RuntimeError instead of falling back, so a run configured for the kernel never silently
    measures the reference path.
    """
    if not x.is_cuda:
        raise RuntimeError(
            f"Mamba2Config.use_kernel=True needs CUDA inputs, got device {x.device}; "
            "set use_kernel=False to use the pure-PyTorch SSD"
        )
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except ImportError as err:
        raise RuntimeError(
            "Mamba2Config.use_kernel=True needs the mamba_ssm package (pip install mamba-ssm); "
            "set use_kernel=False to use the pure-PyTorch SSD"
        ) from err
    # dt is already softplus(dt + dt_bias), so the kernel gets no bias and no softplus; D is added
    # by the caller so that both paths share it.
    y, final_state = mamba_chunk_scan_combined(
        x, dt, A, B, C, chunk_size, initial_states=initial_state, return_final_states=True
    )
    return y, final_state
