"""hspec inside vLLM (pinned 0.32, CPU build; docs/vllm.md).

- `export`: hspec's DFlash checkpoints in the layout vLLM's `dflash` method loads;
- `engine`: run the target in vLLM with one speculative configuration and measure it;
- `proposer`: H-Spec as a vLLM proposer (`method: custom_class`), reading the target's paged KV cache in place;
- `plugin`: the `vllm.general_plugins` entry point: vLLM's DFlash drafts from the anchor slot as hspec's does,
  and the model runner hands `proposer.HSpecProposer` the target's tapped hidden states and attention metadata.

Nothing here imports vLLM at module level, so hspec works without it.
"""
