"""KV-cache accounting from model configs: the paper's Table 1 (KV inflation per token).

A drafter that keeps its own context KV (DFlash, DSpark, P-Eagle) stores, for every token of every
sequence, K and V for each of its layers next to the target's. Per token:

    target KV  = L_target  x 2 x Hkv x D x bytes
    drafter KV = L_drafter x 2 x Hkv_d x D_d x bytes
    KV inflation = (target KV + drafter KV) / target KV

so a 5-layer DFlash drafter with the target's KV dims inflates a 36-layer Qwen3 target's KV by
1 + 5/36 = 1.139 and a 32-layer Llama-3.1-8B's by 1 + 5/32 = 1.156 (paper Table 1); H-Spec reads the
target's KV in place and adds nothing (1.000).

The target configs below are small literal facts: the published `config.json` values of each model
on the Hugging Face hub (repository named in `source`). Nothing is downloaded.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from hspec.cache.paged_pool import kv_bytes_per_token
from hspec.models.config import RopeScaling, TargetConfig

# bf16, the serving dtype of the paper's measurements; the inflation ratio does not depend on it.
DEFAULT_BYTES_PER_ELEMENT = 2


@dataclass(frozen=True)
class KnownTarget:
    """A target's published config values (legend: L layers, Hkv KV heads, D head dim, H, I, V)."""

    name: str  # short name used on the command line, e.g. "qwen3-8b"
    source: str  # where the numbers come from: the hub repository whose config.json they are
    config: TargetConfig


KNOWN_TARGETS: tuple[KnownTarget, ...] = (
    KnownTarget("qwen3-4b", "Qwen/Qwen3-4B config.json", TargetConfig(
        architecture="Qwen3ForCausalLM", vocab_size=151936, hidden_size=2560, intermediate_size=9728,
        num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
        max_position_embeddings=40960, tie_word_embeddings=True, qk_norm=True)),
    KnownTarget("qwen3-8b", "Qwen/Qwen3-8B config.json", TargetConfig(
        architecture="Qwen3ForCausalLM", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
        num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
        max_position_embeddings=40960, tie_word_embeddings=False, qk_norm=True)),
    KnownTarget("llama-3.1-8b-instruct", "meta-llama/Llama-3.1-8B-Instruct config.json", TargetConfig(
        architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192), max_position_embeddings=131072,
        tie_word_embeddings=False)),
    KnownTarget("smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct config.json (the embedded default)",
                TargetConfig(
        architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True)),
)


def known_target(name: str) -> KnownTarget:
    """Look up a literal target config by its short name (case-insensitive)."""
    for t in KNOWN_TARGETS:
        if t.name == name.lower():
            return t
    raise ValueError(f"unknown target config {name!r}; known: {[t.name for t in KNOWN_TARGETS]}")


def kv_inflation(target: TargetConfig, drafter_kv_bytes_per_token: int,
                 bytes_per_element: int = DEFAULT_BYTES_PER_ELEMENT) -> float:
    """(target KV + drafter KV per token) / target KV, both at `bytes_per_element`."""
    target_bytes = kv_bytes_per_token(target.num_layers, target.num_kv_heads, target.head_dim, bytes_per_element)
    return (target_bytes + drafter_kv_bytes_per_token) / target_bytes


@dataclass(frozen=True)
class KVRow:
    """One line of the table: a (target, drafter) pair."""

    target: str
    drafter: str
    target_layers: int  # L
    kv_heads: int  # Hkv
    head_dim: int  # D
    drafter_kv_layers: int  # layers of drafter-side context KV (0 = reads the target's KV or none)
    target_kv_bytes_per_token: int
    drafter_kv_bytes_per_token: int
    kv_inflation: float
    source: str

    def to_dict(self) -> dict:
        return asdict(self)


# (drafter label, drafter-side KV layers with the target's KV dims). DFlash/DSpark: 5 layers, each
# with its own W_k/W_v over the fused context (docs/design.md#dflash-family); H-Spec: none (#h-spec).
TABLE1_DRAFTERS: tuple[tuple[str, int], ...] = (("DFlash (5 layers)", 5), ("H-Spec", 0))


def kv_table(bytes_per_element: int = DEFAULT_BYTES_PER_ELEMENT,
             drafters: tuple[tuple[str, int], ...] = TABLE1_DRAFTERS) -> list[KVRow]:
    """Table 1 for every known target: one row per (target, drafter)."""
    rows = []
    for t in KNOWN_TARGETS:
        c = t.config
        target_bytes = kv_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, bytes_per_element)
        for label, layers in drafters:
            drafter_bytes = kv_bytes_per_token(layers, c.num_kv_heads, c.head_dim, bytes_per_element)
            rows.append(KVRow(t.name, label, c.num_layers, c.num_kv_heads, c.head_dim, layers, target_bytes,
                              drafter_bytes, kv_inflation(c, drafter_bytes, bytes_per_element), t.source))
    return rows


def format_kv_table(rows: list[KVRow]) -> str:
    """A Markdown table of `rows`."""
    lines = ["| target | drafter | L | Hkv | D | drafter KV layers | target KV B/token | drafter KV B/token "
             "| KV inflation |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.target} | {r.drafter} | {r.target_layers} | {r.kv_heads} | {r.head_dim} | "
                     f"{r.drafter_kv_layers} | {r.target_kv_bytes_per_token:,} | {r.drafter_kv_bytes_per_token:,} | "
                     f"{r.kv_inflation:.3f} |")
    return "\n".join(lines)
