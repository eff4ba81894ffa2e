"""Stage 3, simulate: run one training step on fake tensors and replay what the allocator would see."""
