"""hspec's vLLM plugin (entry point `vllm.general_plugins: hspec`, pinned vLLM 0.32): DFlash sampling from the
anchor, and the model-runner hooks H-Spec's proposer needs.

vLLM calls `register()` in every process it starts (API server, engine core, workers) before it builds
a model runner. What it changes, and only for drafters that ask for it:

1. DFlash (`patch_dflash`):

hspec's DFlash block [x0, MASK x K] predicts a token at every slot, the anchor's included: slot k gives
the draft for position p+k+1 (`sample_from_anchor`, docs/design.md#the-decoding-step). vLLM 0.32's V1
DFlash proposer reads slot j >= 1 as the draft for position p+j, i.e. it samples the K MASK slots
(`_copy_and_expand_dflash_inputs` writes token index req*(K+1) + j for j = 1..K). For a drafter whose
`dflash_config.sample_from_anchor` is true (hspec's export sets it; vLLM's own DFlash checkpoints
default to false and are left alone), the patch moves those indices back one slot, to j = 0..K-1: the
drafts of hspec's block of K+1 slots. Everything else (context K/V, attention, verification) is vLLM's.

2. H-Spec (`patch_runner`), only when the runner's drafter is `proposer.HSpecProposer` (method
`custom_class`); every other drafter goes through vLLM's code untouched:
   - after the target loads, the runner outputs the hidden states of the drafter's tapped layers
     (`use_aux_hidden_state_outputs`, `set_aux_hidden_state_layers(target_layers)`), as it does for EAGLE-3;
   - after each step, `propose_draft_token_ids` calls `HSpecProposer.propose_with_target` with those
     hidden states, the step's attention metadata and its spec-decode metadata, instead of vLLM's
     token-only custom-class call.
"""

from __future__ import annotations

from typing import Any

_PATCHED = "_hspec_patched"


def samples_from_anchor(hf_config: Any) -> bool:
    """True when a DFlash drafter's config asks for hspec's semantics (`dflash_config.sample_from_anchor`)."""
    return bool((getattr(hf_config, "dflash_config", None) or {}).get("sample_from_anchor", False))


def register() -> None:
    """Patch vLLM for hspec's drafters (module docstring); idempotent."""
    patch_dflash()
    patch_runner()


def patch_dflash() -> None:
    """Make vLLM's DFlash proposer sample from the anchor slot when the drafter asks."""
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


def patch_runner() -> None:
    """Give an `HSpecProposer` the target's tapped hidden states and the step's attention metadata."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # the CPU runner subclasses it

    from hspec.integrations.vllm.proposer import HSpecProposer

    setup_original = GPUModelRunner._setup_eagle3_aux_hidden_state_outputs
    propose_original = GPUModelRunner.propose_draft_token_ids
    if getattr(setup_original, _PATCHED, False):
        return

    def setup_aux_outputs(self) -> None:  # type: ignore[no-untyped-def]
        drafter = getattr(self, "drafter", None)
        if not isinstance(drafter, HSpecProposer):
            return setup_original(self)
        from vllm.model_executor.models.interfaces import supports_eagle3

        if not supports_eagle3(self.get_model()):
            raise RuntimeError(f"H-Spec needs the target's hidden states of layers {drafter.aux_hidden_state_layers}; "
                               f"vLLM's {type(self.get_model()).__name__} does not output aux hidden states")
        self.use_aux_hidden_state_outputs = True
        self.model.set_aux_hidden_state_layers(drafter.aux_hidden_state_layers)
        return None

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata,  # type: ignore[no-untyped-def]
                                hidden_states, sample_hidden_states, aux_hidden_states, spec_decode_metadata,
                                common_attn_metadata, slot_mappings):
        if not isinstance(getattr(self, "drafter", None), HSpecProposer):
            return propose_original(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                                    sample_hidden_states, aux_hidden_states, spec_decode_metadata,
                                    common_attn_metadata, slot_mappings)
        self._draft_probs = None
        self._draft_prob_req_ids = None
        return self.drafter.propose_with_target(sampled_token_ids, aux_hidden_states, common_attn_metadata,
                                                spec_decode_metadata, self.input_batch.req_ids)

    for patched in (setup_aux_outputs, propose_draft_token_ids):
        setattr(patched, _PATCHED, True)
    GPUModelRunner._setup_eagle3_aux_hidden_state_outputs = setup_aux_outputs  # type: ignore[method-assign]
    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids  # type: ignore[method-assign]
