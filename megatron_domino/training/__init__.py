"""Training: the loop, checkpoints, metrics, preemption and the entry-point command line."""
