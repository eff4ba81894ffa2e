"""The CUDA memory model: what a CUDA training step needs beyond what the CPU simulation sees."""
