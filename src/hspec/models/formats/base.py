"""What every weight format shares: the protocol of a product and the row blocking that keeps a row's bits.

A weight format is one row of a table (llama.cpp's type traits): how a floating (N, K) weight is stored
(`store`), how rows are multiplied by what it stored (`product`), and what the floating weight is again
(`floating_weight`). A linear module holds its tensors under fixed names (weight, bias, weight_scale,
weight_packed: the native stack and the native drafter read them by those names) and the format chosen
for them once, at load (`formats.store`); nothing looks at a tensor's dtype to decide how to multiply.

Row invariance. Greedy speculative decoding is lossless only if a token's logits come out the same
whether the target computes it alone (a 1-token decode) or as one row of a (K+1)-token verify. In float32
the kernels' rounding differences stay far below a logit gap; in bfloat16 on the CPU they do not (4 of 62
greedy choices flipped, docs/fast-path.md). So a reduced-precision CPU product gets at most `ROW_BLOCK`
rows (`WeightFormat.__call__`), and each format's `product` computes a row the same way however many rows
share its call. A prompt's prefill, which plain and speculative decoding share, need not keep a decode's
bits: `WeightFormat.prefill` multiplies all its rows in one floating product.

Legend: M rows, N output features, K input features.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from hspec.models.dtype import cpu_has_native_bf16

# Most rows one product of a decode or a verify takes. oneDNN's bf16 product gave each row the same bits
# in calls of 2 to 32 rows; on an AMX CPU a call of 33 or more rows runs another kernel, and 1-57 of 64
# rows of SmolLM2's products came out otherwise (and 132 of 5,872 verify rows of a 16-token attention).
# So a larger call (a batch of sequences, a long verify, a recompute after preemption) runs in blocks.
ROW_BLOCK = 32


def row_invariant(x: torch.Tensor) -> bool:
    """True when `x` takes the row-invariant kernels (reduced precision on the CPU; see the module doc)."""
    return x.dtype != torch.float32 and x.device.type == "cpu"


def emulated_bf16(x: torch.Tensor, native_bf16: bool | None = None) -> bool:
    """Whether x is bf16 on a CPU without native bf16 dot products (AVX2 only), where torch computes a bf16
    product in software: a prompt's 128 rows through SmolLM2's layers took 2.1 s in bf16 against 0.35 s in
    fp32 on an AVX2-only EPYC (docs/fast-path.md#an-avx2-host). A decode's few rows stay bf16 (they are bound by
    reading the weights, and the int8 and int4 kernels take bf16 rows). `native_bf16`: whether the CPU has
    them (None: this CPU's flags)."""
    if x.dtype != torch.bfloat16 or x.device.type != "cpu":
        return False
    return not (cpu_has_native_bf16() if native_bf16 is None else native_bf16)


class WeightFormat:
    """One storage of a linear weight and its product. Subclasses set `name` and define `product`, and
    `floating_weight` where the stored weight is not the floating one. Instances are immutable values
    (a format and, where it has two, which kernel multiplies it), shared by every module stored that way."""

    name = "floating"
    # Axis of `weight_scale` that runs over the N outputs (a stacked matrix's parts are views along it).
    scale_rows_axis = 0

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 scale: torch.Tensor | None, packed: torch.Tensor | None) -> torch.Tensor:
        """A decode's or a verify's product: x (..., K) -> (..., N), a row with the bits it gets alone.

        A row-invariant x runs in products of at most `ROW_BLOCK` rows. A product autograd records (a
        drafter's training step under bf16 autocast) needs no row invariance and runs in one call."""
        rows = x.numel() // x.shape[-1]
        flat = x.reshape(rows, x.shape[-1])  # (M, K)
        trained = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
        block = ROW_BLOCK if row_invariant(x) and not trained else max(rows, 1)
        if rows <= block:  # one product (a decode, a short verify): no slicing, which costs a dispatch per call
            out = self.product(flat, weight, bias, scale, packed)
        else:
            out = torch.cat([self.product(flat[start : start + block], weight, bias, scale, packed)
                             for start in range(0, rows, block)])
        return out.reshape(*x.shape[:-1], weight.shape[0])

    def product(self, flat: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                scale: torch.Tensor | None, packed: torch.Tensor | None) -> torch.Tensor:
        """flat (M, K), M <= `ROW_BLOCK` where row-invariant -> (M, N), each row's bits independent of M."""
        raise NotImplementedError

    def prefill(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                scale: torch.Tensor | None, packed: torch.Tensor | None, native_bf16: bool | None = None
                ) -> torch.Tensor:
        """A prompt's product, x (..., K) -> (..., N): the floating weight in one call, which is faster for
        hundreds of rows than a quantized kernel working a few rows at a time (512 rows of SmolLM2's gate/up
        matrix: int8 kernel 22 ms, int4 20, dequantizing int8 and multiplying 4.1, bf16 1.5; 1 thread).
        Other bits than `__call__`'s: plain and speculative decoding share the prompt's prefill, so their
        outputs stay equal. On a CPU without native bf16 a bf16 prompt's product runs in fp32 (`native_bf16`:
        whether the CPU has bf16 dot products; None: this CPU's flags)."""
        floating = self.floating_weight(weight, scale, x.dtype)
        if emulated_bf16(x, native_bf16):
            return F.linear(x.float(), floating.float(), None if bias is None else bias.float()).to(x.dtype)
        return F.linear(x, floating, bias)

    def floating_weight(self, weight: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """The (N, K) weight this storage multiplies, as floating values (a quantized weight dequantized)."""
        return weight

    def __deepcopy__(self, memo: dict) -> WeightFormat:
        return self  # an immutable value: a copied model shares it

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"


class StoredWeight(NamedTuple):
    """A weight held outside a linear module (a drafter's pruned head, its Markov head, a GRU's gates): its
    format and the tensors the format multiplies. Called like a module: x (..., K) -> (..., N)."""

    format: WeightFormat
    weight: torch.Tensor  # (N, K) in the format's storage
    scale: torch.Tensor | None
    packed: torch.Tensor | None  # the copy a kernel reads, or None

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.format(x, self.weight, bias, self.scale, self.packed)
