"""hspec: lossless speculative decoding with the H-Spec drafter and its baselines."""
