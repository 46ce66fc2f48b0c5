"""megatron_domino: GPT/Llama pretraining with Domino TP overlap, 1F1B pipelines and ZeRO data parallelism."""

__version__ = "0.1.0"
