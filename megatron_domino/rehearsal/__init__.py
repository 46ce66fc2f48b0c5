"""Rehearsals: a full-size job played on fake CUDA devices in one CPU process (tools/rehearse.py)."""
