"""Pipeline schedules, their simulator and timeline, checked against independent references.

Theory used for the closed forms (uniform costs, no comm latency): in 1F1B every rank does m forwards (f) and
m backwards (b); the last rank starts (pp-1)f late and the first finishes (pp-1)b after the last, so each rank
idles (pp-1)(f+b) of a makespan (m+pp-1)(f+b): bubble (pp-1)/(m+pp-1). Interleaving with v chunks makes each
op 1/v as long while the fill/drain still crosses pp-1 ranks per direction once: bubble (pp-1)/(v*m+pp-1).
"""
import re
from collections import Counter
from fractions import Fraction

import pytest

from megatron_domino.pipeline.program import Instruction, TransferGroup, computes_of, transfers_of
from megatron_domino.pipeline.schedules import SCHEDULES, build_schedule
from megatron_domino.pipeline.simulate import Costs, ScheduleError, simulate
from megatron_domino.pipeline.timeline import render_timeline
from tests.tools import load_tool

print_schedule = load_tool("print_schedule")

_OPS = {"rF": "recv_forward", "F": "forward", "sF": "send_forward",
        "rB": "recv_backward", "B": "backward", "I": "backward_input", "sB": "send_backward", "W": "backward_weight"}


def _instruction(token):
    prefix, mb, chunk = re.fullmatch(r"([rs]?[FB]|I|W)(\d+)(?:\.(\d+))?", token).groups()
    return Instruction(_OPS[prefix], int(mb), int(chunk or 0))


def parse(text):
    """'F0 [sF0 rB1.1] B0' -> program (test-side reader of the papers' notation; [...] is one transfer group)."""
    out = []
    for token in re.findall(r"\[[^\]]*\]|\S+", text):
        if token.startswith("["):
            out.append(TransferGroup(tuple(_instruction(t) for t in token[1:-1].split())))
        else:
            out.append(_instruction(token))
    return out


def flat(program):
    return [t for step in program for t in (step.transfers if isinstance(step, TransferGroup) else (step,))]


def unbatched(schedule, v=1):
    """The order the pipeline used before grouping: each transfer alone, right beside its compute."""
    pp, out = len(schedule), []
    for rank, program in enumerate(schedule):
        steps = []
        for inst in (i for i in flat(program) if i.is_compute):
            recvs, sends = transfers_of(inst, inst.chunk * pp + rank, pp * v)
            steps += [TransferGroup((t,)) for t in recvs] + [inst] + [TransferGroup((t,)) for t in sends]
        out.append(steps)
    return out


def computes(program, op):
    return [(i.chunk, i.microbatch) for i in program if i.op == op]


def channel_orders(schedule):
    """Per (src, dst, kind): sequence of (microbatch, destination stage) as sent and as received."""
    pp, sent, received = len(schedule), {}, {}
    for rank, program in enumerate(schedule):
        for inst in flat(program):
            if inst.is_compute:
                continue
            stage = inst.chunk * pp + rank
            kind = "act" if inst.op.endswith("forward") else "grad"
            if inst.op.startswith("send"):
                dst_stage = stage + 1 if kind == "act" else stage - 1
                sent.setdefault((rank, dst_stage % pp, kind), []).append((inst.microbatch, dst_stage))
            else:
                src_stage = stage - 1 if kind == "act" else stage + 1
                received.setdefault((src_stage % pp, rank, kind), []).append((inst.microbatch, stage))
    return sent, received


def check_common(schedule, m, v, result):
    pp = len(schedule)
    sent, received = channel_orders(schedule)
    assert sent == received  # every send matched by one receive, in the same order on every channel
    expected = Counter((c, mb) for c in range(v) for mb in range(m))
    for rank, program in enumerate(schedule):
        assert Counter(computes(program, "forward")) == expected
        assert Counter(computes(program, "backward")) == expected
        ran = [(s.instruction.op, s.instruction.chunk, s.instruction.microbatch) for s in result.spans[rank]]
        assert Counter(ran) == Counter(("forward", c, mb) for c, mb in expected) + \
            Counter(("backward", c, mb) for c, mb in expected)
        stage_first = [rank == 0 and c == 0 for c in range(v)]
        stage_last = [rank == pp - 1 and c == v - 1 for c in range(v)]
        for inst in flat(program):
            if inst.op in ("recv_forward", "send_backward"):
                assert not stage_first[inst.chunk]
            if inst.op in ("send_forward", "recv_backward"):
                assert not stage_last[inst.chunk]
    assert max(s.end for row in result.spans for s in row) == result.makespan


def test_every_schedule_runs_each_chunks_forwards_in_micro_batch_order():
    """The MoE global balance loss numbers a step's micro-batches in the order they reach a layer (``models.moe``):
    micro-batch j must be the j-th forward of its chunk on every rank, in training and evaluation programs."""
    checked = Counter()
    for name in SCHEDULES:
        for pp in range(1, 5):
            for virtual_pp in (1, 2, 3):
                for m in range(1, 10):
                    for forward_only in (False, True):
                        try:
                            programs = build_schedule(name, pp, m, virtual_pp, forward_only)
                        except ValueError:  # a combination the schedule does not take
                            continue
                        for program in programs:
                            forwards = {}
                            for inst in (i for step in program for i in computes_of(step) if i.op == "forward"):
                                forwards.setdefault(inst.chunk, []).append(inst.microbatch)
                            assert all(order == list(range(m)) for order in forwards.values()), \
                                (name, pp, virtual_pp, m, forward_only, forwards)
                        checked[name] += 1
    assert set(checked) == set(SCHEDULES), checked


@pytest.mark.parametrize("pp", range(1, 9))
def test_1f1b_matches_theory(pp):
    for m in range(1, 33):
        schedule = build_schedule("1f1b", pp, m)
        result = simulate(schedule, m, costs=Costs(forward=1, backward=2))
        check_common(schedule, m, 1, result)
        simulate(build_schedule("1f1b", pp, m, forward_only=True), m, forward_only=True)
        assert result.max_in_flight == [min(pp - r, m) for r in range(pp)]
        assert result.makespan == (m + pp - 1) * 3
        bubble = Fraction(pp - 1, m + pp - 1)
        assert Fraction(result.bubble_fraction).limit_denominator(1000) == bubble
        assert all(abs(x - float(bubble)) < 1e-12 for x in result.idle_fraction)


@pytest.mark.parametrize("pp", range(2, 9))
def test_interleaved_matches_theory(pp):
    for v in range(2, 5):
        for m in range(pp, 33, pp):
            schedule = build_schedule("interleaved", pp, m, v)
            result = simulate(schedule, m, v, Costs(forward=1, backward=2))
            check_common(schedule, m, v, result)  # even pp=2, where both kinds share a pair
            simulate(build_schedule("interleaved", pp, m, v, forward_only=True), m, v, forward_only=True)
            bubble = Fraction(pp - 1, v * m + pp - 1)
            assert result.makespan == (v * m + pp - 1) * 3
            assert Fraction(result.bubble_fraction).limit_denominator(10000) == bubble
            # Bound implemented (Megatron's warm-up): rank r keeps at most warm-up + 1 chunk-micro-batches, with
            # warm-up = 2(pp-r-1) + (v-1)pp, or all m*v when m == pp. A chunk is 1/v of a stage, so that is
            # pp + (pp-2r-1)/v stage-activations: rank 0 is the worst with pp + (pp-1)/v (1F1B: pp).
            for r in range(pp):
                warmup = m * v if m == pp else min(2 * (pp - r - 1) + (v - 1) * pp, m * v)
                assert result.max_in_flight[r] == min(warmup + 1, m * v)
            assert max(result.max_in_flight) == result.max_in_flight[0]


def test_paper_orders():
    assert build_schedule("none", 1, 3) == [parse("F0 B0 F1 B1 F2 B2")]
    assert build_schedule("1f1b", 1, 3) == build_schedule("none", 1, 3)
    one = build_schedule("1f1b", 4, 8)
    assert [str(i) for i in one[0] if i.is_compute] == "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7".split()
    assert one[3][:5] == parse("[rF0] F0 B0 [sB0 rF1] F1")
    assert one[0][:6] == parse("F0 [sF0] F1 [sF1] F2 [sF2]") and one[0][7:10] == parse("[sF3 rB0] B0 F4")
    # Interleaved iterations pair a forward with a backward; receives are posted one iteration ahead.
    # Steady state: one group sends both outputs and receives both inputs (Megatron's 4-way exchange).
    assert parse("F3.0 B1.1 [sF3.0 sB1.1 rF2.1 rB0.0] F2.1 B0.0") == build_schedule("interleaved", 2, 4, 2)[0][11:16]
    # Interleaved: groups of pp micro-batches sweep the chunks; backwards sweep them in reverse.
    inter = build_schedule("interleaved", 2, 4, 2)
    fwd = [i.label(True) for i in inter[1] if i.op == "forward"]
    bwd = [i.label(True) for i in inter[1] if i.op == "backward"]
    assert fwd == "F0.0 F1.0 F0.1 F1.1 F2.0 F3.0 F2.1 F3.1".split()
    assert bwd == "B0.1 B1.1 B0.0 B1.0 B2.1 B3.1 B2.0 B3.0".split()
    assert str(Instruction("forward", 3, 1)) == "F3.1" and str(Instruction("send_backward", 3)) == "sB3"


def test_simulated_times_by_hand():
    # pp=2, m=1, comm 0.5: F0@r0 [0,1]; arrives 1.5; F0@r1 [1.5,2.5]; B0@r1 [2.5,4.5]; arrives 5; B0@r0 [5,7].
    result = simulate(build_schedule("1f1b", 2, 1), 1, costs=Costs(1, 2, 0.5))
    assert [(s.start, s.end) for s in result.spans[0]] == [(0, 1), (5, 7)]
    assert [(s.start, s.end) for s in result.spans[1]] == [(1.5, 2.5), (2.5, 4.5)]
    assert result.makespan == 7 and result.busy == [3, 3] and result.idle == [4, 4]
    # Per-stage costs: a slow second stage.
    slow = simulate(build_schedule("1f1b", 2, 1), 1, costs=Costs([1, 3], [2, 4]))
    assert [(s.start, s.end) for s in slow.spans[1]] == [(1, 4), (4, 8)] and slow.makespan == 10


def test_timeline_by_hand():
    result = simulate(build_schedule("1f1b", 2, 2), 2, costs=Costs(1, 2))
    assert render_timeline(result) == ("rank 0 | F0 F1 .  .  B0    .  B1\n"
                                       "rank 1 | .  F0 B0    F1 B1    .  .")
    inter = render_timeline(simulate(build_schedule("interleaved", 2, 2, 2), 2, 2))
    assert inter.splitlines()[0].startswith("rank 0 | F0.0 F1.0 ")


def test_cli(capsys):
    assert print_schedule.main(["--pp", "4", "--microbatches", "8"]) == 0
    out = capsys.readouterr().out
    assert "bubble fraction 0.2727" in out and out.count("\nrank ") >= 8
    assert print_schedule.main(["--pp", "4", "--microbatches", "6", "--virtual", "2"]) == 2
    assert "parallel.pp = 4" in capsys.readouterr().err


def test_zb_h1_matches_its_closed_form_and_holds_1f1b_memory():
    """ZB-H1 under NCCL's rules (the simulator): with F = I = W (the backward split evenly) and m >= pp every rank
    idles (pp-1)(F + I - W) of m(F + I + W) + (pp-1)(F + I - W), i.e. bubble (pp-1)/(3m + pp-1), a third of 1F1B's;
    it holds at most pp micro-batches (F to W) on every rank, 1F1B's peak; every (pp, m) up to 8, 32 finishes."""
    for pp in range(1, 9):
        for m in range(1, 33):
            schedule = build_schedule("zb-h1", pp, m)
            result = simulate(schedule, m, costs=Costs(forward=1, backward=2))
            simulate(build_schedule("zb-h1", pp, m, forward_only=True), m, forward_only=True)
            assert result.max_in_flight == [min(pp, m)] * pp
            for rank, program in enumerate(schedule):
                assert Counter(computes(program, "backward_weight")) == Counter((0, mb) for mb in range(m))
                assert Counter(computes(program, "backward_input")) == Counter((0, mb) for mb in range(m))
            if m >= pp:
                assert result.makespan == 3 * m + pp - 1
                assert all(abs(x - (pp - 1) / (3 * m + pp - 1)) < 1e-12 for x in result.idle_fraction)
    one, zb = (simulate(build_schedule(k, 4, 16), 16).bubble_fraction for k in ("1f1b", "zb-h1"))
    assert zb < one / 2  # the target at pp 4, m 16: 0.059 against 0.158
    assert build_schedule("zb-h1", 2, 2) == [parse("F0 [sF0] F1 [sF1 rB0] I0 W0 [rB1] I1 W1"),
                                             parse("[rF0] F0 [rF1] I0 [sB0] F1 I1 [sB1] W0 W1")]


@pytest.mark.parametrize("args, words", [
    (("none", 2, 4), ["parallel.pp = 2", "Fix"]),
    (("1f1b", 2, 4, 2), ["parallel.virtual_pp = 2", "interleaved"]),
    (("interleaved", 1, 4, 2), ["parallel.pp = 1", "Fix"]),
    (("interleaved", 2, 4, 1), ["parallel.virtual_pp = 1", "Fix"]),
    (("interleaved", 4, 6, 2), ["train.global_batch_size", "= 6", "parallel.pp = 4", "parallel.virtual_pp", "Fix"]),
    (("1f1b", 2, 0), ["train.global_batch_size", "fix"]),
    (("gpipe", 2, 4), ["'gpipe'", "1f1b", "zb-h1"]),
    (("zb-h1", 2, 4, 2), ["'zb-h1'", "parallel.virtual_pp = 2", "Fix"]),
])
def test_build_errors(args, words):
    with pytest.raises(ValueError) as err:
        build_schedule(*args)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_simulator_catches_bad_schedules():
    fifo = [parse("F1 [sF1] F0 [sF0] [rB0] B0 [rB1] B1"), build_schedule("1f1b", 2, 2)[1]]
    with pytest.raises(ScheduleError, match="rank 1 rF0 would receive sF1 from rank 0.*different orders"):
        simulate(fifo, 2)
    with pytest.raises(ScheduleError, match="F1 runs before its receive rF1"):
        simulate([build_schedule("1f1b", 2, 2)[0], parse("[rF0] F0 B0 [sB0] F1 [rF1] B1 [sB1]")], 2)
    with pytest.raises(ScheduleError, match="sF0 comes before F0"):
        simulate([parse("[sF0] F0 F1 [sF1 rB0] B0 [rB1] B1"), build_schedule("1f1b", 2, 2)[1]], 2)
    with pytest.raises(ScheduleError, match="transfers missing: sF1"):
        simulate([parse("F0 [sF0] F1 [rB0] B0 [rB1] B1"), build_schedule("1f1b", 2, 2)[1]], 2)
    with pytest.raises(ScheduleError, match="B0 runs before its forward"):
        simulate([parse("B0 F0")], 1)
    with pytest.raises(ScheduleError, match=r"missing \[\(0, 1\)\]"):
        simulate([parse("F0 B0")], 2)
    # Consistent per kind but not per pair: on one untagged NCCL pair (pp=2) the wrong tensor arrives.
    mixed = [parse("F0.0 [sF0.0] F1.0 [sF1.0] [rF0.1] F0.1 [sF0.1] [rB0.1] B0.1 [sB0.1] [rF1.1] F1.1 [sF1.1] "
                   "[rB1.1] B1.1 [sB1.1] [rB0.0] B0.0 [rB1.0] B1.0"),
             parse("[rF0.0] F0.0 [sF0.0] [rF1.0] F1.0 [sF1.0] [rF0.1] F0.1 B0.1 [sB0.1] [rF1.1] F1.1 B1.1 [sB1.1] "
                   "[rB0.0] B0.0 [sB0.0] [rB1.0] B1.0 [sB1.0]")]
    with pytest.raises(ScheduleError, match="different orders"):
        simulate(mixed, 2, 2)


@pytest.mark.slow
def test_simulator_finds_the_unbatched_deadlock_and_proves_the_grouped_schedules():
    """Sends as rendezvous, pairs FIFO, groups complete together: the old one-transfer-at-a-time order hangs
    at pp 2 with 4 micro-batches exactly as the issue traced it; every grouped schedule up to pp 8, m 32, v 4
    (training and forward-only) finishes."""
    with pytest.raises(ScheduleError) as err:
        simulate(unbatched(build_schedule("1f1b", 2, 4)), 4)
    assert str(err.value) == ("deadlock under NCCL's rules: rank 0: waits at [sF1] (step 3) for rank 1 to post its "
                              "side of sF1; rank 1: waits at [sB0] (step 3) for rank 0 to post its side of sB0")
    hung = 0
    for pp in range(2, 9):
        for v in (1, 2, 3, 4):
            kind = "1f1b" if v == 1 else "interleaved"
            for m in range(pp, 33, pp):
                schedule = build_schedule(kind, pp, m, v)
                simulate(schedule, m, v)
                simulate(build_schedule(kind, pp, m, v, forward_only=True), m, v, forward_only=True)
                try:
                    simulate(unbatched(schedule, v), m, v)
                except ScheduleError:
                    hung += 1
    assert hung >= 0.9 * sum(len(range(pp, 33, pp)) for pp in range(2, 9)) * 4  # the old order hangs almost always


def test_print_schedule_shows_zb_h1(capsys):
    assert print_schedule.main(["--pp", "4", "--microbatches", "8", "--kind", "zb-h1", "--ops"]) == 0
    out = capsys.readouterr().out
    assert "bubble fraction 0.1111" in out and " W7" in out and "[sB0]" in out


def test_print_schedule_shows_the_groups(capsys):
    assert print_schedule.main(["--pp", "2", "--microbatches", "2", "--ops"]) == 0
    out = capsys.readouterr().out
    assert "rank 0 ops: F0 [sF0] F1 [sF1 rB0] B0 [rB1] B1" in out
    assert "rank 1 ops: [rF0] F0 B0 [sB0 rF1] F1 B1 [sB1]" in out
