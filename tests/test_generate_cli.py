"""tools/generate.py: greedy output equals transformers' at tp 2 under torchrun (gloo, NCCL's rules emulated) from
checkpoints converted at tp 1 × pp 2, and at tp 1 from tp 2 × pp 2; a sample at tp 2 equals tp 1's with the same
seed; bad requests are refused with the fix, before any process group starts."""
import os
import re
import subprocess
import sys

import pytest
import torch

from megatron_domino.config import load_config
from megatron_domino.generation import command
from megatron_domino.generation.decode import generate
from megatron_domino.generation.sampling import Sampling, TokenPicker
from tests.test_convert import _load_native
from tests.test_generate import PROMPT, converted, hf_greedy
from tests.training_runs import REPO, environment

pytest.importorskip("transformers")

GENERATE = os.path.join(REPO, "tools", "generate.py")
STRICT = ["parallel.backend=gloo", "parallel.strict_transport=true", "parallel.timeout_s=60"]


def generated_ids(load: str, ranks: int, *args: str) -> list[int]:
    """The ids tools/generate.py prints (``--print-ids``) on ``ranks`` ranks (torchrun beyond one)."""
    launcher = [] if ranks == 1 else ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    result = subprocess.run([sys.executable, *launcher, GENERATE, "--load", load, "--prompt-ids",
                             " ".join(map(str, PROMPT)), "--print-ids", *args, *STRICT], cwd=REPO,
                            env=environment(), capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    [line] = [line for line in result.stdout.splitlines() if line.startswith("ids: ")]
    return [int(token) for token in line.split()[1:]]


@pytest.mark.parametrize("name", [pytest.param("gpt2", marks=pytest.mark.slow),
                                  pytest.param("llama", marks=pytest.mark.slow), "mixtral",
                                  pytest.param("qwen3", marks=pytest.mark.slow)])
def test_greedy_at_tp2_equals_transformers(name, tmp_path):
    hf_model, native = converted(name, tmp_path, tp=1, pp=2)
    assert generated_ids(native, 2, "--max-new-tokens", "10") == hf_greedy(hf_model, PROMPT, 10)


@pytest.mark.slow
def test_greedy_at_tp1_from_tp2_pp2_and_a_sample_at_tp2_as_at_tp1(tmp_path):
    """One process from a tp 2 × pp 2 checkpoint; then sampling at tp 2 (rank 0 samples, every rank takes its
    token) draws what one process draws from the same seed: the logits agree to far below a draw's margin."""
    hf_model, native = converted("qwen3_moe", tmp_path)
    assert generated_ids(native, 1, "--max-new-tokens", "8") == hf_greedy(hf_model, PROMPT, 8)
    sampled = generated_ids(native, 2, "--max-new-tokens", "8", "--temperature", "1.0", "--top-k", "20",
                            "--top-p", "0.9", "--seed", "3")
    model = _load_native(native, load_config(os.path.join(native, "config.yaml")).model)
    warm = Sampling(temperature=1.0, top_k=20, top_p=0.9, seed=3)
    assert sampled == generate(model, PROMPT, 8, TokenPicker(warm, torch.device("cpu"), model.cfg.vocab_size))


@pytest.fixture(scope="module")
def gpt2_checkpoint(tmp_path_factory):
    return converted("gpt2", tmp_path_factory.mktemp("generate"), tp=1, pp=2)[1]


@pytest.mark.parametrize("args, message", [
    (["--prompt-ids", "1 2", "parallel.pp=2"], "parallel.pp = 2: generation runs the whole model on every rank"),
    (["--prompt-ids", "1 2", "parallel.cp=2"], "parallel.cp = 2: generation runs the whole model on every rank"),
    (["--prompt", "Once upon a time"], "--prompt = 'Once upon a time': the checkpoint's tokenizer is NullTokenizer, "
                                       "which reads no text. Fix: pass token ids with --prompt-ids"),
    (["--prompt-ids", "1 2 3 4", "--max-new-tokens", "29"], "--max-new-tokens = 29: the prompt's 4 tokens and the "
     "new ones would pass model.max_position_embeddings = 32 .* Fix: ask for at most 28 new tokens"),
    (["--prompt-ids", "1 two"], "--prompt-ids = '1 two': must be token ids separated by spaces"),
    (["--prompt-ids", "1 300"], "id 300 lies outside the vocabulary"),
    (["--prompt-ids", "1 2", "--top-k", "5"], "--temperature = 0.0: 0 means greedy"),
])
def test_bad_requests_are_refused_before_any_process_group(gpt2_checkpoint, no_process_group, capsys, args, message):
    argv = ["--load", gpt2_checkpoint, "--max-new-tokens", "3", *args]  # a later --max-new-tokens wins
    assert command.main(argv) == 2
    assert re.search(message, capsys.readouterr().err)


def test_a_missing_checkpoint_is_named(tmp_path, capsys):
    assert command.main(["--load", str(tmp_path / "nowhere"), "--prompt-ids", "1", "--max-new-tokens", "1"]) == 2
    assert "nowhere' is not a directory" in capsys.readouterr().err
