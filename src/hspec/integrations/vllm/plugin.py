"""hspec's vLLM plugin (entry point `vllm.general_plugins: hspec`, pinned vLLM 0.32): DFlash sampling from the anchor.

vLLM calls `register()` in every process it starts (API server, engine core, workers) before it builds
a model runner. What it changes, and only for drafters whose config asks for it:

hspec's DFlash block [x0, MASK x K] predicts a token at every slot, the anchor's included: slot k gives
the draft for position p+k+1 (`sample_from_anchor`, docs/design.md#the-decoding-step). vLLM 0.32's V1
DFlash proposer reads slot j >= 1 as the draft for position p+j, i.e. it samples the K MASK slots
(`_copy_and_expand_dflash_inputs` writes token index req*(K+1) + j for j = 1..K). For a drafter whose
`dflash_config.sample_from_anchor` is true (hspec's export sets it; vLLM's own DFlash checkpoints
default to false and are left alone), the patch moves those indices back one slot, to j = 0..K-1: the
drafts of hspec's block of K+1 slots. Everything else (context K/V, attention, verification) is vLLM's.

H-Spec's own proposer is not here yet (docs/vllm.md lists the steps).
"""

from __future__ import annotations

from typing import Any

_PATCHED = "_hspec_sample_from_anchor"


def samples_from_anchor(hf_config: Any) -> bool:
    """True when a DFlash drafter's config asks for hspec's semantics (`dflash_config.sample_from_anchor`)."""
    return bool((getattr(hf_config, "dflash_config", None) or {}).get("sample_from_anchor", False))


def register() -> None:
    """Patch vLLM's DFlash proposer to sample from the anchor slot when the drafter asks (idempotent)."""
    from vllm.v1.spec_decode.dflash import DFlashProposer

    original = DFlashProposer.set_inputs_first_pass
    if getattr(original, _PATCHED, False):
        return

    def set_inputs_first_pass(self, *args: Any, **kwargs: Any):  # type: ignore[no-untyped-def]
        num_tokens, token_indices_to_sample, attn_metadata = original(self, *args, **kwargs)
        if samples_from_anchor(self.draft_model_config.hf_config):
            # (B*K,) query-row indices of slots 1..K -> slots 0..K-1 of the same requests.
            token_indices_to_sample = token_indices_to_sample - 1
        return num_tokens, token_indices_to_sample, attn_metadata

    setattr(set_inputs_first_pass, _PATCHED, True)
    DFlashProposer.set_inputs_first_pass = set_inputs_first_pass  # type: ignore[method-assign]
