"""Conversion between Hugging Face checkpoints and native full-size state dicts."""
