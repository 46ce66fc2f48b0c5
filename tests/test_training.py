"""End-to-end training through the entry points: layouts, resume, resharding, preemption, crash safety."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from megatron_domino.convert.native_io import NativeTensors
from tests.training_runs import REPO, environment, kill_group, losses, metrics, start, train, wait_for_step, worker_pids

pytestmark = pytest.mark.slow  # multi-rank training runs: the whole suite, not -m quick

TOL = 1e-5
LAYOUT_222 = ["parallel.tp=2", "parallel.pp=2", "parallel.dp=2", "parallel.domino=true"]
# Packed documents: offsets sliced by Domino's rows, read by every stage from host memory.
DOCUMENTS = ["data.reset_attention_mask=true", "data.reset_position_ids=true"]


def _assert_close(run, reference, steps, tol=TOL):
    for step in steps:
        assert abs(run[step] - reference[step]) <= tol * abs(reference[step]), (step, run[step], reference[step])


# tp 2 x cp 2 x pp 2: context parallelism through the trainer (its split of each micro-batch), ZeRO over dp x cp.
CONTEXT_PARALLEL = [*LAYOUT_222, "parallel.sequence_parallel=true", "parallel.dp=1", "parallel.cp=2"]
DROPOUT = ["model.hidden_dropout=0.1", "model.attention_dropout=0.1"]  # so a resume must restore every RNG stream


@pytest.mark.parametrize("family, world, layout, data", [
    ("gpt", 4, ["parallel.tp=2", "parallel.pp=1", "parallel.dp=2", "parallel.domino=true"], []),
    ("llama", 4, ["parallel.tp=1", "parallel.pp=2", "parallel.dp=2"], []),
    ("llama", 8, CONTEXT_PARALLEL, DOCUMENTS)],
    ids=["gpt-tp2-dp2-domino", "llama-pp2-dp2", "llama-tp2-cp2-pp2-sequence-parallel-documents"])
def test_layouts_match_one_process(tmp_path, family, world, layout, data):
    """10 steps as a bare process and at the layout under torchrun with ZeRO-2: the same losses, gradient norms
    and final weights (within 1e-5)."""
    single, parallel = str(tmp_path / "single"), str(tmp_path / "parallel")
    train(family, 1, single, ["train.steps=10", *data])
    train(family, world, parallel, ["train.steps=10", "optimizer.zero_stage=2", *layout, *data])
    one, many = losses(single), losses(parallel)
    assert sorted(one) == list(range(1, 11)) and sorted(many) == list(range(1, 11))
    _assert_close(many, one, range(1, 11))
    assert one[10] < one[1]
    norms = {r["step"]: r["grad_norm"] for r in metrics(single)}
    parallel_norms = {r["step"]: r["grad_norm"] for r in metrics(parallel)}
    assert sorted(parallel_norms) == sorted(norms)
    _assert_close(parallel_norms, norms, norms)
    final_single, final_parallel = _stored(single, 10), _stored(parallel, 10)
    assert sorted(final_single) == sorted(final_parallel)
    for name, tensor in final_single.items():  # after 10 ZeRO-2 AdamW steps
        other = final_parallel[name]
        if name.endswith("qkv.bias"):  # see _without_key_bias
            tensor, other = _without_key_bias(tensor), _without_key_bias(other)
        err = ((other - tensor).abs().max() / tensor.abs().max()).item()
        assert err <= TOL, (name, err)


def _without_key_bias(qkv_bias, head_dim=16):
    """The key bias's gradient is exactly zero in exact arithmetic (softmax ignores a constant shift), so
    it is pure rounding noise, which Adam divides by its own size into full-size steps: it cannot agree
    between layouts and carries no signal. Rows per group (MHA): [query | key | value] x head_dim."""
    rows = qkv_bias.view(-1, 3, head_dim)
    return torch.cat([rows[:, 0], rows[:, 2]], dim=1)


def _stored(run, step, prefix="model/", folder="checkpoints"):
    """Every tensor under ``prefix`` of the run's checkpoint of ``step``, whole, by name."""
    source = NativeTensors(os.path.join(run, folder, f"step_{step:08d}"), prefix)
    return {name: source.get(name) for name in source.keys()}


def assert_bitwise_resume(base: str, resumed: str, steps) -> None:
    """The resumed run's ``steps`` have the base run's losses, and its last checkpoint the same weights and
    optimizer state, bit for bit."""
    reference, again = losses(base), losses(resumed)
    assert sorted(again) == list(steps)
    for step in again:
        assert again[step] == reference[step], (step, again[step], reference[step])
    for prefix in ("model/", "optim/"):
        whole, continued = _stored(base, steps[-1], prefix), _stored(resumed, steps[-1], prefix)
        assert whole and sorted(whole) == sorted(continued), prefix
        for name, tensor in whole.items():
            assert torch.equal(tensor, continued[name]), (prefix, name)


def test_resume_reshards(tmp_path):
    """Save at pp 2 x dp 2 with ZeRO-1; resume at dp 4 with ZeRO-2, tp 2 x dp 2, and tp 2 x pp 2 with virtual_pp
    2 (within 1e-5): each rank reads only the slices it needs. Under DualPipeV at the same pp 2 x dp 2 the resume
    is bitwise: pipeline rank 0 reads the word embedding twice (its tied copy, too)."""
    base = str(tmp_path / "base")
    train("gpt", 4, base, ["train.steps=9", "checkpoint.interval=6", "checkpoint.keep=0", "optimizer.zero_stage=1",
                           "parallel.tp=1", "parallel.pp=2", "parallel.dp=2"])
    reference, step6 = losses(base), os.path.join(base, "checkpoints", "step_00000006")
    for layout in (["parallel.tp=1", "parallel.pp=1", "parallel.dp=4", "optimizer.zero_stage=2"],
                   ["parallel.tp=2", "parallel.pp=1", "parallel.dp=2", "parallel.domino=true"],
                   ["parallel.tp=2", "parallel.pp=2", "parallel.dp=1", "parallel.virtual_pp=2"],
                   ["parallel.tp=1", "parallel.pp=2", "parallel.dp=2", "parallel.virtual_pp=2",
                    "parallel.pipeline_schedule=dualpipev"]):
        run = str(tmp_path / "-".join(layout))
        train("gpt", 4, run, ["train.steps=9", f"checkpoint.load={step6}", "checkpoint.dir=" + run + "/ckpt",
                              "checkpoint.save_at_end=false", *layout])
        moved = losses(run)
        assert sorted(moved) == list(range(7, 10))
        exact = "parallel.pipeline_schedule=dualpipev" in layout
        _assert_close(moved, reference, range(7, 10), tol=0 if exact else TOL)


LAYOUT_4 = ["parallel.tp=2", "parallel.pp=2", "parallel.dp=1", "parallel.domino=true"]


def test_sigterm_saves_and_exits_zero(tmp_path):
    run = str(tmp_path / "run")
    proc = start("gpt", 4, run, ["train.steps=500", *LAYOUT_4], str(tmp_path / "log.txt"))
    try:
        wait_for_step(run, 3, proc)
        for pid in worker_pids(proc.pid):  # as slurm does: every task gets the signal
            os.kill(pid, signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, open(tmp_path / "log.txt").read()[-4000:]
    finally:
        kill_group(proc)
    assert 3 <= _resume_one_step(tmp_path, os.path.join(run, "checkpoints")) < 500


def _resume_one_step(tmp_path, root) -> int:
    """Load ``latest`` under ``root`` in a single process and train one more step; returns the loaded step."""
    with open(os.path.join(root, "latest")) as f:
        latest = json.load(f)
    assert os.path.exists(os.path.join(root, latest["dir"], "metadata.json"))
    resumed = str(tmp_path / "resumed")
    train("gpt", 1, resumed, [f"checkpoint.load={root}", f"train.steps={latest['step'] + 1}",
                              "checkpoint.save_at_end=false"])
    assert sorted(losses(resumed)) == [latest["step"] + 1]
    return latest["step"]


def _saves_in_flight(root: str) -> list[str]:
    return [os.path.join(root, name) for name in os.listdir(root) if name.startswith(".tmp-step_")]


def _kill_inside_a_save(root: str, ranks: list[int], victim: int, timeout: float = 60.0) -> None:
    """SIGKILL rank ``victim`` while a save is in flight under ``root`` and its own data file is not written yet
    (torch.distributed.checkpoint's ``__<rank>_*.distcp``): the save then cannot complete. Every rank is frozen
    (SIGSTOP) from the look into the folder to the kill, so nothing moves in between; then the others go on."""
    deadline = time.monotonic() + timeout
    while True:
        while not _saves_in_flight(root):
            assert time.monotonic() < deadline, f"no save in flight under {root} within {timeout:g}s"
            time.sleep(0.005)
        for pid in ranks:
            os.kill(pid, signal.SIGSTOP)
        caught = any(not any(name.startswith(f"__{victim}_") for name in os.listdir(tmp))
                     for tmp in _saves_in_flight(root))
        if caught:
            os.kill(ranks[victim], signal.SIGKILL)
        for rank, pid in enumerate(ranks):
            if rank != victim or not caught:
                os.kill(pid, signal.SIGCONT)
        if caught:
            return
        time.sleep(0.005)


def test_killed_rank_while_saving_leaves_latest_whole(tmp_path):
    """kill -9 of one rank inside a background save (one starts every step): the run fails, the save is cut
    short (its temporary folder is left, never published), and ``latest`` names a whole checkpoint."""
    run = str(tmp_path / "run")
    root = os.path.join(run, "checkpoints")
    proc = start("gpt", 4, run, ["train.steps=500", "checkpoint.interval=1", "checkpoint.keep=2",
                                 "checkpoint.async_save=true", *LAYOUT_4], str(tmp_path / "log.txt"))
    try:
        wait_for_step(run, 4, proc)
        _kill_inside_a_save(root, worker_pids(proc.pid), victim=3)
        status = proc.wait(timeout=120)
    finally:
        kill_group(proc)
    assert status != 0, "the run went on without one of its ranks"
    assert any(name.startswith(".tmp-step_") for name in os.listdir(root)), os.listdir(root)
    _resume_one_step(tmp_path, root)  # latest names a whole checkpoint


def test_eval_only_writes_validation_loss(tmp_path):
    run = str(tmp_path / "run")
    train("gpt", 1, run, ["train.steps=4", "train.eval_interval=2"])
    assert [r["step"] for r in metrics(run, "valid")] == [2, 4]
    evaluation = str(tmp_path / "eval")
    result = train("gpt", 1, evaluation, ["--eval-only", f"checkpoint.load={run}/checkpoints"])
    records = metrics(evaluation, "valid")
    assert len(records) == 1 and records[0]["step"] == 4
    assert abs(records[0]["loss"] - metrics(run, "valid")[-1]["loss"]) <= 1e-6
    assert "validation at step 4" in result.stdout
    with pytest.raises(AssertionError, match="model.num_layers: checkpoint 4 vs config 2"):
        train("gpt", 1, str(tmp_path / "other"), ["--eval-only", f"checkpoint.load={run}/checkpoints",
                                                   "model.num_layers=2"])


def test_converted_hf_llama_evaluates_on_four_ranks_as_transformers_does(tmp_path):
    """HF Llama (GQA, untied, Llama-3.1 RoPE) -> hf-to-native at tp2 pp2 -> --eval-only on 4 ranks = HF's loss."""
    transformers = pytest.importorskip("transformers")
    from megatron_domino.config import load_config
    from megatron_domino.convert.convert import hf_to_native
    from megatron_domino.data import build_train_valid_test_datasets
    torch.manual_seed(1)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=0, rope_parameters={"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0,
                                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 16})).eval()
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    native = str(tmp_path / "native")
    hf_to_native(str(tmp_path / "hf"), native, tp=2, pp=2, quiet=True)
    overrides = ["--eval-only", "train.micro_batch_size=2", "train.global_batch_size=4", "train.eval_iters=1",
                 "data.mock=true", "data.split=50,50,0", f"log.dir={tmp_path}/eval", "log.tensorboard=false",
                 "optimizer.warmup_steps=0", "parallel.domino=true", "parallel.dp=1"]
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                             os.path.join(REPO, "pretrain_llama.py"), "--config", f"{native}/config.yaml", *overrides],
                            cwd=REPO, env=environment(), capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-4000:]
    ours = metrics(str(tmp_path / "eval"), "valid")[0]["loss"]
    cfg = load_config(f"{native}/config.yaml", [o for o in overrides if "=" in o])
    _, valid, _ = build_train_valid_test_datasets(cfg, (4, 4, 0))
    batch = [valid[i] for i in range(4)]
    tokens = torch.stack([s["tokens"] for s in batch])
    labels = torch.stack([s["labels"] for s in batch])
    with torch.no_grad():
        logits = hf(tokens).logits
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)).item()
    assert abs(ours - expected) <= 1e-5 * expected, (ours, expected)
