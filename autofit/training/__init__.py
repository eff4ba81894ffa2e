"""What one training step is, shared by the simulation, ``measure`` and the trainer: the batch and its length, the
loss and its normalisation over micro-batches, the optimizer, precision and stored precision, the optimizer step in
backward and the strategy that shards the step (``step.py`` runs it: one definition, so that the step simulated,
measured and trained is the same)."""
