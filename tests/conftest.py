"""Every test runs under NCCL's rules: the strict pipeline transport (rendezvous sends, untagged order) and the
collective device checks are on for every rank the tests start, in-process or through torchrun
(see megatron_domino/parallel/strict.py)."""
import os

from megatron_domino.parallel.strict import ENV_SWITCH

os.environ[ENV_SWITCH] = "1"
