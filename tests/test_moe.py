"""The mixture-of-experts layer against references written here: the router's losses against their closed
forms, capacity drops against a token-by-token queue, the layer against loops over tokens and experts (output
and every gradient, auxiliary losses included), TP (Domino, sequence parallel) and PP training against one
process (fp32), and an MoE checkpoint resharded from tp 2 to tp 1."""
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from megatron_domino.config import ModelConfig
from megatron_domino.models import LanguageModel, initialize_weights
from megatron_domino.models.expert_bias import update_expert_biases
from megatron_domino.models.counters import count_parameters, flops_per_token
from megatron_domino.models.moe import MoE
from megatron_domino.models.router import Selection, route, within_capacity
from megatron_domino.models.tokens import TokenContext
from megatron_domino.tensor_parallel import LayerContext
from tests.harness import run_ranks
from tests.parity import assert_covered, assert_same_run, layout_config, train_steps
from tests.test_pipeline import GLOBAL_BATCH, MICRO_BATCH
from tests.test_zero_bubble import LR, OPT, _batches as zero_bubble_batches

E, K = 4, 2
GPT_MOE = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, seq_length=16,
                      vocab_size=200, make_vocab_size_divisible_by=8, num_experts=E, moe_topk=K,
                      moe_ffn_hidden_size=32, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
LLAMA_MOE = replace(GPT_MOE, num_attention_heads=8, num_query_groups=4, position_embedding="rope", norm="rmsnorm",
                    activation="swiglu", bias=False, tie_embeddings=False, moe_router="sigmoid", moe_shared_experts=1,
                    moe_capacity_factor=1.0)


# ---------------------------------------------------------------- the router

def test_aux_and_z_loss_equal_their_closed_forms():
    logits = torch.randn(24, E, generator=torch.Generator().manual_seed(0)) * 2
    for router in ("softmax", "sigmoid"):
        routing = route(logits, K, router, None)
        counts, prob_sums = [0] * E, [0.0] * E
        for row in logits.tolist():
            if router == "softmax":
                probs = [math.exp(v) / sum(math.exp(u) for u in row) for v in row]
                chosen = sorted(range(E), key=lambda e: -probs[e])[:K]
            else:
                scores = [1 / (1 + math.exp(-v)) for v in row]
                probs = [s / sum(scores) for s in scores]
                chosen = sorted(range(E), key=lambda e: -scores[e])[:K]
            for e in chosen:
                counts[e] += 1
            prob_sums = [a + p for a, p in zip(prob_sums, probs)]
        tokens = len(logits)
        aux = E * sum(c / (tokens * K) * p / tokens for c, p in zip(counts, prob_sums))
        z = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.tolist()) / tokens
        assert routing.aux_loss.item() == pytest.approx(aux, rel=1e-5), router
        assert routing.z_loss.item() == pytest.approx(z, rel=1e-5), router
        assert routing.counts.tolist() == counts


def test_deepseek_selection_equals_its_closed_form():
    """Group-limited routing (8 experts in 4 groups, a token's 2 groups with the best top-2 score sums), an expert
    bias that moves the choice but not the gates, gates scaled and left unnormalised or renormalised."""
    logits = torch.randn(16, 8, generator=torch.Generator().manual_seed(2))
    bias = torch.tensor([0.3, -0.2, 0.0, 0.5, -0.4, 0.1, 0.2, -0.1])
    for normalize in (True, False):
        selection = Selection(normalize=normalize, scale=2.5, groups=4, topk_group=2, bias=bias)
        routing = route(logits, 3, "sigmoid", None, selection)
        plain = route(logits, 3, "sigmoid", None, Selection(groups=4, topk_group=2))
        for t, row in enumerate(logits.tolist()):
            scores = [1 / (1 + math.exp(-v)) for v in row]
            ranked = [s + b for s, b in zip(scores, bias.tolist())]
            group_score = [sum(sorted(ranked[2 * g:2 * g + 2])[-2:]) for g in range(4)]
            groups = sorted(range(4), key=lambda g: -group_score[g])[:2]
            allowed = [e for e in range(8) if e // 2 in groups]
            chosen = sorted(allowed, key=lambda e: -ranked[e])[:3]
            assert routing.experts[t].tolist() == chosen, t
            top = [scores[e] for e in chosen]
            gates = [2.5 * s / (sum(top) if normalize else 1.0) for s in top]
            assert routing.gates[t].tolist() == pytest.approx(gates, rel=1e-5), t
        assert torch.equal(routing.unbiased_counts, plain.counts)  # the load the bias-free router gives
        assert not torch.equal(routing.counts, plain.counts)  # this bias does move some tokens


def test_capacity_drops_what_a_token_ordered_queue_drops():
    g = torch.Generator().manual_seed(1)
    experts = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(40)])
    for capacity in (0, 3, 12, 40):
        filled, want = [0] * E, []
        for token in experts.tolist():
            want.append([filled[e] < capacity for e in token])
            for e in token:
                filled[e] += 1
        assert within_capacity(experts, E, capacity).tolist() == want


# ---------------------------------------------------------------- the layer

def _reference_layer(moe: MoE, cfg, x, capacity_factor):
    """Loops over tokens and experts: (output, aux loss, z-loss) of the MoE layer, as plain autograd math."""
    tokens = x.reshape(-1, cfg.hidden_size)
    count = len(tokens)
    capacity = math.inf if capacity_factor is None else math.ceil(count * K * capacity_factor / E)

    def mlp(module, v):
        y = F.linear(v, module.fc1.weight, module.fc1.bias)
        y = F.silu(y[:y.shape[0] // 2]) * y[y.shape[0] // 2:] if cfg.activation == "swiglu" else F.gelu(y)
        return F.linear(y, module.fc2.weight, module.fc2.bias)

    outputs, filled, counts, prob_sum, z_sum = [], [0] * E, [0] * E, 0, 0
    for token in tokens:
        logits = F.linear(token, moe.router.weight)
        scores = torch.softmax(logits, -1) if cfg.moe_router == "softmax" else torch.sigmoid(logits)
        chosen = sorted(range(E), key=lambda e: -scores[e].item())[:K]
        total = sum(scores[e] for e in chosen)
        out = mlp(moe.shared_experts, token) if moe.shared_experts is not None else torch.zeros_like(token)
        for e in chosen:
            if filled[e] < capacity:
                out = out + scores[e] / total * mlp(moe.experts[str(e)], token)
            filled[e] += 1
            counts[e] += 1
        outputs.append(out)
        prob_sum = prob_sum + scores / scores.sum() if cfg.moe_router == "sigmoid" else prob_sum + scores
        z_sum = z_sum + torch.logsumexp(logits, -1) ** 2
    aux = E * sum(c / (count * K) * prob_sum[e] / count for e, c in enumerate(counts))
    return torch.stack(outputs).reshape(x.shape), aux, z_sum / count


def _layer_and_input(cfg, samples: int):
    """A single-process MoE layer with large random weights, an input of ``samples`` samples and an output grad."""
    torch.manual_seed(0)
    moe = MoE(cfg, LayerContext())
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(samples, cfg.seq_length, cfg.hidden_size, requires_grad=True)
    return moe, x, torch.randn(samples, cfg.seq_length, cfg.hidden_size)


@pytest.mark.parametrize("cfg", [GPT_MOE, LLAMA_MOE, replace(GPT_MOE, moe_capacity_factor=0.5, moe_shared_experts=2),
                                 replace(GPT_MOE, moe_grouped_gemm=True), replace(LLAMA_MOE, moe_grouped_gemm=True)],
                         ids=["softmax-gelu-bias", "sigmoid-swiglu-shared-capacity", "softmax-shared-drops",
                              "grouped-gemm-bias", "grouped-gemm-swiglu"])
def test_layer_equals_loops_over_tokens_and_experts(cfg):
    moe, x, grad_out = _layer_and_input(cfg, 2)
    moe.begin_step(0.7)
    out, bias = moe.project(moe.hidden(x))
    out = out + bias if bias is not None else out
    got = torch.autograd.grad((out * grad_out).sum(), [x, *moe.parameters()])

    want_out, aux, z = _reference_layer(moe, cfg, x, cfg.moe_capacity_factor)
    objective = (want_out * grad_out).sum() + 0.7 * 2 * (cfg.moe_aux_loss_coeff * aux + cfg.moe_z_loss_coeff * z)
    want = torch.autograd.grad(objective, [x, *moe.parameters()])
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    for name, g, w in zip(["x"] + [n for n, _ in moe.named_parameters()], got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=name)
    values = moe.stats.values
    assert values[E + 1].item() == x.shape[0] * cfg.seq_length * K  # assignments counted
    assert values[E + 2].item() == pytest.approx(aux.item(), rel=1e-5)


@pytest.mark.parametrize("cfg", [GPT_MOE, replace(LLAMA_MOE, moe_capacity_factor=None),
                                 replace(LLAMA_MOE, moe_capacity_factor=None, moe_seq_aux_loss_coeff=0.3)],
                         ids=["softmax", "sigmoid", "sequence-wise"])
def test_a_micro_batch_routed_in_pieces_has_the_losses_of_the_whole(cfg):
    """Domino's row split routes each mu-chunk on its own: with the pieces sharing one balance set, outputs,
    gradients (balance and z-loss included) and the logged losses equal one routing of the whole micro-batch."""
    moe, x, grad_out = _layer_and_input(cfg, 4)
    results = []
    for pieces in (1, 2, 4):
        moe.begin_step(0.7)
        context = TokenContext(balance={})
        rows = [slice(i * 4 // pieces, (i + 1) * 4 // pieces) for i in range(pieces)]
        routed = [moe.hidden(x[r], context.rows(r, pieces)) for r in rows]  # every piece routes before any projects
        out = torch.cat([moe.project(piece)[0] for piece in routed])
        got = torch.autograd.grad((out * grad_out).sum(), [x, *moe.parameters()])
        results.append((out, got, moe.stats.values.clone()))
    (whole, want, stats), pieces = results[0], results[1:]
    for out, got, values in pieces:
        torch.testing.assert_close(out, whole, rtol=1e-6, atol=1e-6)
        for name, g, w in zip(["x"] + [n for n, _ in moe.named_parameters()], got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=name)
        torch.testing.assert_close(values, stats, rtol=1e-6, atol=1e-9)  # aux, z-loss, one micro-batch
    assert stats[E + 4].item() == pytest.approx(1.0)


def test_layer_freq_picks_the_moe_layers():
    for freq, want in ((1, [True] * 4), (2, [True, False, True, False]), ([0, 1, 1, 0], [False, True, True, False])):
        cfg = replace(GPT_MOE, num_layers=4, moe_layer_freq=freq)
        model = LanguageModel(cfg)
        assert [isinstance(block.mlp, MoE) for block in model.layers] == want
        assert [i for i, _ in model.moe_layers()] == [i for i, moe in enumerate(want) if moe]
    names = {n for n, _ in LanguageModel(LLAMA_MOE).named_global_parameters()}
    assert {"layers.1.mlp.router.weight", "layers.1.mlp.experts.3.fc1.weight", "layers.1.mlp.experts.3.fc2.weight",
            "layers.1.mlp.shared_experts.fc1.weight"} <= names


def test_counters_report_total_and_active_parameters():
    """Total = every parameter of the built model; active = top-k experts only; FLOPs count the active weights."""
    for cfg in (GPT_MOE, LLAMA_MOE, replace(LLAMA_MOE, num_layers=4, moe_layer_freq=2)):
        assert count_parameters(cfg) == sum(p.numel() for p in LanguageModel(cfg).parameters())
        expert = sum(p.numel() for p in MoE(cfg, LayerContext()).experts["0"].parameters())
        moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
        assert count_parameters(cfg, active=True) == count_parameters(cfg) - moe_layers * (E - K) * expert
        matrices = (3 if cfg.activation == "swiglu" else 2) * cfg.hidden_size
        experts_run = K + cfg.moe_shared_experts
        extra = moe_layers * (E * cfg.hidden_size + matrices * (experts_run * cfg.moe_ffn_size - cfg.ffn_size))
        assert flops_per_token(cfg) == flops_per_token(replace(cfg, num_experts=None)) + 6 * extra  # vs dense MLPs


# ---------------------------------------------------------------- TP and PP against one process

STEPS = 3


def _batches(model):
    return zero_bubble_batches(model)[:STEPS]


def _reference(model, group_size, batches=None, norms=None):
    """One process, SGD over ``batches`` (default ``_batches``); tokens routed in groups of ``group_size`` samples
    (a micro-batch), the objective ``loss.Objective``'s: token-mean LM loss + auxiliary losses
    averaged over micro-batches. Appends each step's gradient norm to ``norms``."""
    dense = LanguageModel(model)
    initialize_weights(dense, seed=3)
    trained = [p for p in dense.parameters() if p.requires_grad]  # not an aux-loss-free expert bias
    losses = []
    for tokens, labels, mask in batches or _batches(model):
        dense.zero_grad(set_to_none=True)
        dense.begin_step(1.0 / GLOBAL_BATCH)
        total = 0.0
        for rows in torch.arange(GLOBAL_BATCH).split(group_size):
            per_token = dense(None, {"tokens": tokens[rows], "labels": labels[rows]})[..., 0]
            loss = (per_token * mask[rows]).sum() / mask.sum()
            loss.backward()
            total += loss.item()
        if norms is not None:
            norms.append(torch.stack([p.grad.pow(2).sum() for p in trained]).sum().sqrt().item())
        with torch.no_grad():
            for p in trained:
                p -= LR * p.grad
        update_expert_biases([dense], None)
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in dense.named_global_parameters()}


def _microbatches(model):
    return lambda state: [[{"tokens": t, "labels": l, "loss_mask": m} for t, l, m in
                           zip(tokens.split(MICRO_BATCH), labels.split(MICRO_BATCH), mask.split(MICRO_BATCH))]
                          for tokens, labels, mask in _batches(model)]


def _config(model, tp, pp, **parallel):
    return layout_config(model, MICRO_BATCH, GLOBAL_BATCH, tp=tp, pp=pp, dp=1, **parallel)


# (config, samples whose losses are computed together): the micro-batch, even where Domino's row split routes
# each mu-chunk of one sample on its own
LAYOUTS = [(_config(replace(GPT_MOE, recompute="full"), 2, 1, domino=True), MICRO_BATCH),
           (_config(LLAMA_MOE, 2, 1, domino=True, domino_split="column", sequence_parallel=True), MICRO_BATCH),
           (_config(replace(GPT_MOE, moe_shared_experts=1, moe_capacity_factor=1.0), 1, 2), MICRO_BATCH),
           # the grouped experts' Function computes each half of a split backward once (``ctx.gradients``)
           (_config(replace(LLAMA_MOE, moe_grouped_gemm=True), 1, 2, pipeline_schedule="zb-h1"), MICRO_BATCH)]


def _check(rank, world_size, checkpoint_dir):
    compared = []
    for cfg, group_size in LAYOUTS:
        ref_losses, ref_weights = _reference(cfg.model, group_size)
        losses, weights = train_steps(world_size, cfg, OPT, _microbatches(cfg.model), LR)
        compared.append((assert_same_run((cfg.parallel.tp, cfg.parallel.pp), losses, weights, ref_losses,
                                         ref_weights), list(ref_weights)))
    _check_checkpoint_reshards(rank, checkpoint_dir)
    return compared


def _check_checkpoint_reshards(rank, step_dir):
    """An MoE model saved at tp 2 (experts split like the MLP, router replicated) loads at tp 1 into the same
    weights, read from layout-free names by one process."""
    import torch.distributed as dist
    from megatron_domino.checkpoint_format import tensors
    from megatron_domino.training.checkpoint import model_state, model_targets
    group = dist.new_group([0, 1])
    for cfg in (GPT_MOE, LLAMA_MOE):
        sharded = LanguageModel(cfg, LayerContext(group))
        initialize_weights(sharded, 5, rank, 2)
        path = f"{step_dir}/{cfg.moe_router}"
        tensors.write(path, model_state([sharded], rank), group=group)
        dist.barrier(group)
        if rank == 0:
            whole, expected = LanguageModel(cfg), LanguageModel(cfg)
            initialize_weights(expected, 5)
            tensors.read(path, model_targets([whole], 0), alone=True)
            names = dict(whole.named_global_parameters())
            assert any(".mlp.experts.3.fc2." in n for n in names) and any(".mlp.router." in n for n in names)
            for name, param in expected.named_global_parameters():
                assert torch.equal(names[name], param), name
        dist.barrier(group)


def test_tp_domino_sequence_parallel_and_pipeline_train_like_one_process(tmp_path):
    """One spawn of 2 ranks: tp 2 with Domino's row split and full recompute; tp 2 with SP and the column
    split (sigmoid router, shared expert, capacity drops); pp 2 (1F1B, and ZB-H1's split backward). Auxiliary
    and z-losses on, 3 SGD steps. Then an MoE checkpoint saved at tp 2 loads at tp 1."""
    per_rank = run_ranks(_check, 2, str(tmp_path), timeout=300)
    for index, (cfg, _) in enumerate(LAYOUTS):
        assert_covered(cfg.parallel, [rank[index][0] for rank in per_rank], per_rank[0][index][1])


# ---------------------------------------------------------------- the tiny Mixtral, end to end

@pytest.mark.slow
def test_tiny_mixtral_trains_and_logs_routing(tmp_path):
    """configs/tiny/mixtral.yaml through the Llama entry point on mock data: the loss falls, routing is logged."""
    from tests.training_runs import metrics, train
    result = train("mixtral", 1, str(tmp_path), ["train.steps=20", "log.interval=1", "checkpoint.interval=0",
                                                   "model.moe_capacity_factor=1.0"])
    records = metrics(str(tmp_path))
    assert records[-1]["loss"] < records[0]["loss"] - 0.03
    last = records[-1]
    assert 0 <= last["moe_expert_share_min"] <= 1 / E <= last["moe_expert_share_max"] <= 1
    assert 0 < last["moe_dropped_fraction"] < 0.5 and last["moe_aux_loss"] > 0 and last["moe_z_loss"] > 0
    assert len(last["moe_expert_share"]) == 4 and all(len(layer) == E for layer in last["moe_expert_share"])
    assert "moe aux " in result.stdout and " dropped " in result.stdout


@pytest.mark.slow
def test_tiny_mixtral_balance_loss_does_not_depend_on_the_layout(tmp_path):
    """configs/tiny/mixtral.yaml (balance loss on, fp32), 4 steps: tp 2 with Domino's row split (each mu-chunk
    routed on its own) and dp 2 x ep 2 have one process's losses and logged balance loss within 1e-5."""
    from tests.training_runs import metrics, train
    common = ["train.steps=4", "log.interval=1", "checkpoint.interval=0", "checkpoint.save_at_end=false",
              "model.moe_aux_loss_coeff=0.1", "model.moe_z_loss_coeff=0.01", "train.micro_batch_size=2"]
    runs = {"one process": (1, []),
            "tp 2 Domino rows": (2, ["parallel.tp=2", "parallel.domino=true", "parallel.domino_split=row"]),
            "dp 2 x ep 2": (2, ["parallel.dp=2", "parallel.ep=2"])}
    records = {}
    for name, (ranks, overrides) in runs.items():
        train("mixtral", ranks, str(tmp_path / name.replace(" ", "_")), [*common, *overrides])
        records[name] = metrics(str(tmp_path / name.replace(" ", "_")))
    reference = records.pop("one process")
    for name, got in records.items():
        for want, have in zip(reference, got, strict=True):
            for key in ("loss", "moe_aux_loss", "moe_z_loss"):
                assert have[key] == pytest.approx(want[key], rel=1e-5), (name, want["step"], key)
