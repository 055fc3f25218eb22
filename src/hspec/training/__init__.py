"""Training drafters on their target: data generation, features, anchors, losses, trainer, checkpoints."""
