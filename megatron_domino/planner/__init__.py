"""Parallelism planner: memory and step-time estimates for every valid layout, ranked."""
