"""A drafter's outlook: how far its drafts will be accepted, judged before it drafts, from the target's state.

`KIND:auto` (drafters/cost_aware.py) decides per row and step whether to run the drafter at all. Its back-off
knows only whether drafting paid on the row's earlier steps; the drafter's own confidences, which say much more
(on Spec-Bench a first draft of confidence >= 0.8 pays nine times in ten), exist only once the draft is paid
for. The outlook reads what is free before drafting: the target's hidden states at the row's last committed
token, at the layers the drafter reads anyway (`Drafter.target_layers`, handed to `commit` every step), h, of
F = len(layers) x H features. One linear map per draft position k gives

    S_k = sigmoid(w_k . h + b_k),   S_k ~ P(the target accepts at least k of the K drafts),

made non-increasing in k; a_k = S_k / S_{k-1} (S_0 = 1) is then the chance that draft k is accepted given the
ones before it were, the form `best_draft_length` reads. `KIND:auto` lets a row draft where, by these a_k and this
machine's step costs (the draft's included), the best draft length emits at least `margin` (1) tokens per
decode's cost, as many as a plain step. The map is fitted offline (`fit_outlook`) on recorded greedy decoding: at
every output position, the hidden states there and how many of the drafter's K drafts the target accepted
(`scripts/fit_outlook.py`). It is a property of one drafter checkpoint on one target: it ships beside the
drafter as `outlook.safetensors`.

Losslessness is untouched: whether a row drafts depends on its own committed tokens only (the hidden states are
the target's, row-invariant; the map runs per row), never on this step's drafts or verdict.

Shapes: F features (len(layers) x H), K draft positions, N positions fitted on.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hspec.models.native import kernels_loaded

OUTLOOK_FILE = "outlook.safetensors"  # beside a drafter checkpoint's model.safetensors


@dataclass(frozen=True)
class Outlook:
    """S_k = sigmoid(weight[k] . h + bias[k]) over the hidden states h (F,) of `layers` at a row's last
    committed token (module docstring). weight (K, F) and bias (K,) float32, the features' standardisation
    folded in."""

    weight: torch.Tensor
    bias: torch.Tensor
    layers: tuple[int, ...]
    margin: float = 1.0

    def __post_init__(self) -> None:
        if self.weight.dim() != 2 or self.bias.shape != (self.weight.shape[0],):
            raise ValueError(f"an outlook needs weight (K, F) and bias (K,), got {tuple(self.weight.shape)} and "
                             f"{tuple(self.bias.shape)}")
        if not self.margin >= 1.0:
            raise ValueError(f"an outlook's margin must be >= 1 (a row drafts where that beats a plain step's 1 token "
                             f"per decode's cost by this factor), got {self.margin}")

    def survival(self, hidden: torch.Tensor) -> list[float]:
        """S_1..S_K for one row's hidden states (len(layers), H) or (F,): non-increasing in k. Where hspec's CPU
        kernels are loaded, in one call of `hspec::outlook_survival` (this runs every step of every row); else by
        torch's operators, whose sums may round otherwise."""
        if hidden.numel() != self.weight.shape[1]:
            raise ValueError(f"the outlook reads {self.weight.shape[1]} features (layers {list(self.layers)}), "
                             f"got {hidden.numel()}")
        if hidden.device.type == "cpu" and hidden.dtype in (torch.bfloat16, torch.float32) and kernels_loaded():
            survival = torch.ops.hspec.outlook_survival(hidden, self.weight, self.bias)
        else:
            survival = torch.addmv(self.bias, self.weight, hidden.reshape(-1).to(self.weight.dtype)).sigmoid_()
        out, least = [], 1.0
        for s in survival.tolist():
            least = min(least, s)
            out.append(least)
        return out

    def estimates(self, hidden: torch.Tensor) -> list[float]:
        """a_1..a_K: the chance draft k is accepted given drafts 1..k-1 were, S_k / S_{k-1}."""
        out, before = [], 1.0
        for s in self.survival(hidden):
            out.append(min(1.0, s / before) if before > 0 else 0.0)
            before = s
        return out

    def save(self, path: str | Path, about: dict | None = None) -> None:
        """Write to `path` (a safetensors file; `about`, e.g. what it was fitted on, in its metadata)."""
        meta = {"layers": json.dumps(list(self.layers)), "margin": repr(self.margin), "about": json.dumps(about or {})}
        save_file({"weight": self.weight.contiguous(), "bias": self.bias.contiguous()}, str(path), metadata=meta)

    @classmethod
    def load(cls, path: str | Path) -> Outlook:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if "layers" not in meta:
                raise ValueError(f"{path}: not an outlook file (no 'layers' in its metadata)")
            return cls(f.get_tensor("weight").float(), f.get_tensor("bias").float(),
                       tuple(json.loads(meta["layers"])), float(meta.get("margin", "1.0")))


def load_outlook(checkpoint: str | Path) -> Outlook | None:
    """The outlook shipped beside the drafter checkpoint `checkpoint` (a directory), or None if it has none."""
    path = Path(checkpoint) / OUTLOOK_FILE
    return Outlook.load(path) if path.exists() else None


def fit_outlook(features: torch.Tensor, accepted: torch.Tensor, K: int, layers: Sequence[int], l2: float = 0.1,
                max_iter: int = 200) -> Outlook:
    """Fit S_1..S_K: features (N, F) of N positions, accepted (N,) how many of the K drafts at each the target
    accepted. Each S_k is an L2-regularised logistic regression (`l2` on the standardised features' weights,
    loss per position) of [accepted >= k], fitted by L-BFGS; the standardisation is folded into the result."""
    if features.dim() != 2 or accepted.shape != (features.shape[0],):
        raise ValueError(f"fit_outlook needs features (N, F) and accepted (N,), got {tuple(features.shape)} and "
                         f"{tuple(accepted.shape)}")
    x = features.float()
    mean, scale = x.mean(0), x.std(0) + 1e-6
    z = (x - mean) / scale  # (N, F)
    weights, biases = [], []
    for k in range(1, K + 1):
        w, b = _logistic_regression(z, (accepted >= k).float(), l2, max_iter)
        weights.append(w / scale)
        biases.append(b - (w * mean / scale).sum())
    return Outlook(torch.stack(weights), torch.stack(biases), tuple(layers))


def _logistic_regression(z: torch.Tensor, y: torch.Tensor, l2: float, max_iter: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """w (F,), b () minimising mean BCE(z @ w + b, y) + l2 |w|^2 over z (N, F), y (N,) in {0, 1}, by L-BFGS."""
    w = torch.zeros(z.shape[1], requires_grad=True)
    b = torch.zeros((), requires_grad=True)
    optimizer = torch.optim.LBFGS([w, b], max_iter=max_iter, line_search_fn="strong_wolfe")

    def loss() -> torch.Tensor:
        optimizer.zero_grad()
        value = torch.nn.functional.binary_cross_entropy_with_logits(z @ w + b, y) + l2 * (w * w).sum()
        value.backward()
        return value

    optimizer.step(loss)
    return w.detach(), b.detach()
