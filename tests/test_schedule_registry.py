"""A pipeline schedule is one record (megatron_domino/pipeline/schedules/): a toy schedule written in a temporary module
is seen by the config, the simulator, the executor's builder, the planner, the rehearsal's micro-batch count, the dry
run, --print-schedule, the pictures and the pipeline benchmark's closed forms, with nothing else edited."""
import importlib.util
import os
import sys

import pytest

from megatron_domino.config.errors import ConfigError
from megatron_domino.config.loader import config_from_dict, load_config
from megatron_domino.pipeline import schedules
from megatron_domino.pipeline.simulate import simulate
from megatron_domino.validation import validate_config
from tests.fake_cuda import REPO
from tests.tools import load_tool

GPIPE = '''
"""GPipe (Huang et al. 2019): every forward, then every backward."""
from megatron_domino.pipeline.program import Instruction
from megatron_domino.pipeline.schedules import register
from megatron_domino.pipeline.schedules.record import Schedule, programs


def _build(pp, m, v, forward_only):
    order = lambda rank: ([[Instruction("forward", i)] for i in range(m)]
                          + [[Instruction("backward", i)] for i in range(m)])
    return programs(order, pp, v, forward_only)


GPIPE = register(Schedule(name="gpipe", label="GPipe", summary="all forwards, then all backwards",
                          build=_build, bubble=lambda pp, m, v: pp - 1.0,
                          in_flight=lambda pp, m, v: [m] * pp, order=0))
'''


@pytest.fixture
def gpipe(tmp_path):
    path = tmp_path / "toy_gpipe.py"
    path.write_text(GPIPE)
    spec = importlib.util.spec_from_file_location("toy_gpipe", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        yield module.GPIPE
    finally:
        schedules.unregister("gpipe")


def _cfg(extra=()):
    return load_config(os.path.join(REPO, "configs", "tiny", "gpt.yaml"),
                       ["model.num_layers=4", "parallel.pp=2", "train.global_batch_size=8", "data.mock=true",
                        "tokenizer.type=NullTokenizer", "tokenizer.model=null", *extra])


def test_a_schedule_in_one_new_module_is_seen_everywhere(gpipe, capsys):
    from megatron_domino.planner.pipeline_model import in_flight, pipeline_bubble
    from megatron_domino.planner.search import schedule_choices
    from megatron_domino.rehearsal.rehearse import fewest_microbatches
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        import pipeline_theory
        importlib.reload(pipeline_theory)  # its tables are read from the registry when it is imported
    finally:
        sys.path.remove(os.path.join(REPO, "benchmarks"))
    pipeline_svg = load_tool("draw_schedules").pipeline_svg
    cfg = _cfg(["parallel.pipeline_schedule=gpipe"])
    assert "gpipe" in schedules.names() and validate_config(cfg, world_size=2, check_paths=False) is not None
    programs = schedules.build_schedule("gpipe", 4, 8)
    assert simulate(programs, 8).bubble_fraction == pytest.approx(3 / (8 + 3))  # (pp - 1) / (m + pp - 1)
    assert pipeline_bubble("gpipe", 4, 8) == 3.0 and in_flight(cfg, 1) == [4, 4]  # m = 8 / 2 micro-batches
    assert "gpipe" in schedule_choices(_cfg(), 2, 1, asked=True)
    assert fewest_microbatches(cfg, 1, 0) == 4  # its peak is every micro-batch: no fewer will do
    assert load_tool("print_schedule").main(["--pp", "2", "--microbatches", "4", "--kind", "gpipe"]) == 0
    assert "gpipe" in capsys.readouterr().out
    assert "GPipe" in pipeline_svg("gpipe")
    assert pipeline_theory.closed_form("gpipe", 8, 4) == pytest.approx(3 / 11)


def test_an_unknown_schedule_is_refused_with_the_registered_names():
    cfg = _cfg(["parallel.pipeline_schedule=gpipe"])
    with pytest.raises(ConfigError, match=r"parallel\.pipeline_schedule = 'gpipe'.*1f1b.*dualpipev"):
        validate_config(cfg, world_size=2, check_paths=False)
    assert config_from_dict({"parallel": {"pp": 4, "pipeline_schedule": "zb-v"}}).parallel.virtual_pp == 2
    with pytest.raises(ValueError, match="registered already"):
        schedules.register(schedules.get("1f1b"))
