"""The training objective, outside the pipeline: the engine runs a program with it handed in (``objective.py``)."""
from .objective import Objective, global_token_count

__all__ = ["Objective", "global_token_count"]
