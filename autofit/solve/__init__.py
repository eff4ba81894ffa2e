"""Stage 4, solve: choose micro-batch, accumulation, precision and checkpoint segments for a budget."""
