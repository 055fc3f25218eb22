"""hspec inside vLLM (pinned 0.32, CPU build; docs/vllm.md).

- `export`: hspec's DFlash checkpoints in the layout vLLM's `dflash` method loads;
- `engine`: run the target in vLLM with one speculative configuration and measure it;
- `plugin`: the `vllm.general_plugins` entry point: vLLM's DFlash drafts from the anchor slot as hspec's does.

H-Spec as a vLLM proposer is not built yet; docs/vllm.md gives the chosen hook and the steps left.

Nothing here imports vLLM at module level, so hspec works without it.
"""
