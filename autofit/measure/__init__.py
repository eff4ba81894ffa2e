"""The truth an estimate is judged by: real steps, measured by the allocator (see DESIGN.md, ground truth)."""
