"""The truth an estimate is judged by: real steps, measured by the allocator (docs/memory-model.md, the oracle)."""
