"""Reference receivers: rollout-engine-style modules that place canonical tensors through their own loaders."""
