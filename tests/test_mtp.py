"""Multi-token prediction (models/mtp.py): the shifted targets written out by hand (packed documents included); the
model's losses and gradients equal a reference written from its weights with torch.roll; and training equals one
process (fp32, 1e-5) under TP with Domino and SP at ZeRO-3, the pipeline with the embedding copied to the last stage
(untied, full recompute; tied, Domino), CP with packed documents, and an MoE block (Domino, the balance losses of
the micro-batch); the MTP loss is logged on its own; bad configs are refused before any process group starts.
DeepSeek-V3's hub layout of the modules against the definition: tests/test_mtp_reference.py."""
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from megatron_domino.config import ConfigError
from megatron_domino.data.loader import collate
from megatron_domino.models import LanguageModel, initialize_weights
from megatron_domino.models.expert_bias import update_expert_biases
from megatron_domino.models.language_model import WORD_EMBEDDINGS
from megatron_domino.models.mtp import with_mtp_targets
from megatron_domino.models.ring_attention import split_for_context_parallel
from megatron_domino.validation import validate_config
from tests.harness import run_ranks
from tests.parity import assert_covered, assert_same_run, train_steps
from tests.test_context_parallel import LLAMA_16, _layout, _samples
from tests.test_mla import DEEPSEEK_V3
from tests.test_pipeline import GLOBAL_BATCH, MICRO_BATCH

DEPTH, SCALE, LR = 2, 0.3, 0.5
MTP = replace(LLAMA_16, mtp_num_layers=DEPTH, mtp_loss_scale=SCALE)
DEEPSEEK_MTP = replace(DEEPSEEK_V3, mtp_num_layers=1, mtp_loss_scale=SCALE)
MTP_MOE = replace(MTP, num_experts=4, moe_topk=2, moe_ffn_hidden_size=16, moe_aux_loss_coeff=0.1,
                  moe_seq_aux_loss_coeff=0.05, moe_z_loss_coeff=0.01)  # the last layer, so MTP's blocks, are MoE


@pytest.mark.quick
def test_shifted_targets_written_out():
    """Depth k at position t: token and label t + k, the main mask there; zero past the end or t's document."""
    tokens = torch.tensor([[10, 11, 12, 13, 14, 15]])
    batch = {"tokens": tokens, "labels": tokens + 1, "loss_mask": torch.tensor([[1., 1., 0., 1., 1., 1.]]),
             "doc_offsets": torch.tensor([[0, 3, 6]], dtype=torch.int32)}
    out = with_mtp_targets(batch, 2)
    assert out["mtp_tokens"][0].tolist() == [[11, 12], [12, 13], [13, 14], [14, 15], [15, 15], [15, 15]]
    assert out["mtp_labels"][0].tolist() == [[12, 13], [13, 14], [14, 15], [15, 16], [16, 16], [16, 16]]
    # documents [0, 3) and [3, 6): t + k must stay in t's; the main mask at t + k (position 2 is masked)
    assert out["mtp_mask"][0].tolist() == [[1, 0], [0, 0], [0, 0], [1, 1], [1, 0], [0, 0]]
    del batch["doc_offsets"]
    assert with_mtp_targets(batch, 2)["mtp_mask"][0].tolist() == [[1, 0], [0, 1], [1, 1], [1, 1], [1, 0], [0, 0]]


def _rms(x, weight, eps):
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _by_hand(model, batch):
    """The combined loss from the model's weights: the main blocks as they are, MTP spelled out with torch.roll."""
    cfg, w = model.cfg, dict(model.named_global_parameters())
    tokens, labels, mask = batch["tokens"], batch["labels"], batch["loss_mask"]
    context = model.token_context(batch, tokens.shape[0])
    hidden = F.embedding(tokens, w[WORD_EMBEDDINGS])
    for block in model.layers:
        hidden = block(hidden, context)
    head = w.get("output_layer.weight", w[WORD_EMBEDDINGS])[:cfg.vocab_size]

    def loss_of(x, targets):
        return F.cross_entropy((x @ head.t()).flatten(0, 1), targets.flatten(), reduction="none").view(targets.shape)

    count = mask.sum()
    main = (loss_of(_rms(hidden, w["final_norm.weight"], cfg.norm_eps), labels) * mask).sum() / count
    depths = []
    for k in range(1, cfg.mtp_num_layers + 1):
        module, name = model.mtp.layers[k - 1], f"mtp.layers.{k - 1}"
        shifted_mask = torch.roll(mask, -k, 1)
        shifted_mask[:, -k:] = 0
        embedded = _rms(F.embedding(torch.roll(tokens, -k, 1), w[WORD_EMBEDDINGS]), w[f"{name}.embedding_norm.weight"],
                        cfg.norm_eps)
        joined = torch.cat([embedded, _rms(hidden, w[f"{name}.hidden_norm.weight"], cfg.norm_eps)], dim=-1)
        hidden = module.block(joined @ w[f"{name}.projection.weight"].t(), context)
        normed = _rms(hidden, w[f"{name}.final_norm.weight"], cfg.norm_eps)
        depths.append((loss_of(normed, torch.roll(labels, -k, 1)) * shifted_mask).sum() / count)
    return main + cfg.mtp_loss_scale / cfg.mtp_num_layers * sum(depths)


def _combined(per_token, batch, count, scale=SCALE, depth=DEPTH):
    """The engine's loss of a micro-batch: main and MTP losses over the global count of main tokens."""
    mtp = (per_token[..., 1:] * batch["mtp_mask"]).sum()
    return ((per_token[..., 0] * batch["loss_mask"]).sum() + scale / depth * mtp) / count


@pytest.mark.quick
@pytest.mark.parametrize("tie", [False, True])
def test_losses_and_gradients_equal_the_reference_written_by_hand(tie):
    cfg = replace(MTP, tie_embeddings=tie)
    model = LanguageModel(cfg)
    initialize_weights(model, seed=3)
    tokens = torch.randint(0, cfg.vocab_size, (3, cfg.seq_length + 1), generator=torch.Generator().manual_seed(0))
    mask = (torch.rand(3, cfg.seq_length, generator=torch.Generator().manual_seed(1)) > 0.2).float()
    batch = with_mtp_targets({"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask}, DEPTH)
    params = [p for p in model.parameters()]
    got = _combined(model(None, batch), batch, mask.sum())
    got_grads = torch.autograd.grad(got, params)
    want = _by_hand(model, batch)
    want_grads = torch.autograd.grad(want, params)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for (name, _), g, w in zip(model.named_parameters(), got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7, msg=name)
    without = _combined(model(None, batch), batch, mask.sum(), scale=0.0)
    assert abs(without.item() - got.item()) > 1e-3  # the MTP term counts


def _reference(model, documents):
    """One process, SGD: each micro-batch's combined loss over the batch's main tokens (the MoE losses per
    micro-batch, as the engine weighs them); returns the main losses and the final weights."""
    dense = LanguageModel(model)
    initialize_weights(dense, seed=3)
    losses = []
    for samples in _samples(model, documents):
        dense.zero_grad(set_to_none=True)
        dense.begin_step(1.0 / GLOBAL_BATCH)
        batch = with_mtp_targets(collate(samples), model.mtp_num_layers)
        count, total = batch["loss_mask"].sum(), 0.0
        for start in range(0, GLOBAL_BATCH, MICRO_BATCH):
            part = {key: value[start:start + MICRO_BATCH] for key, value in batch.items()}
            per_token = dense(None, part)
            _combined(per_token, part, count, model.mtp_loss_scale, model.mtp_num_layers).backward()
            total += ((per_token[..., 0] * part["loss_mask"]).sum() / count).item()
        with torch.no_grad():
            for p in dense.parameters():
                if p.requires_grad:
                    p -= LR * p.grad
        update_expert_biases([dense], None)
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in dense.named_global_parameters()}


def _train(world_size, cfg, documents, logged):
    depth = cfg.model.mtp_num_layers

    def steps(ps):
        per_rank = GLOBAL_BATCH // ps.dp_size
        for samples in _samples(cfg.model, documents):
            mine = samples[ps.dp_rank * per_rank:(ps.dp_rank + 1) * per_rank]
            yield [split_for_context_parallel(with_mtp_targets(collate(mine[i:i + MICRO_BATCH]), depth),
                                              ps.cp_size, ps.cp_rank) for i in range(0, per_rank, MICRO_BATCH)]

    engines = []
    losses, weights = train_steps(world_size, cfg, cfg.optimizer, steps, LR, check_engine=engines.append)
    logged.append(engines[0].loss.mtp_loss.item())
    return losses, weights


def _check(rank, world_size, layouts):
    compared, logged = [], []
    for cfg, documents in layouts:
        ref_losses, ref_weights = _reference(cfg.model, documents)
        losses, weights = _train(world_size, cfg, documents, logged)
        where = (cfg.parallel.tp, cfg.parallel.cp, cfg.parallel.pp, cfg.parallel.dp, cfg.model.tie_embeddings)
        compared.append((assert_same_run(where, losses, weights, ref_losses, ref_weights), list(ref_weights)))
    return compared, logged


def _with(layout, model=None, **parallel):
    """``layout`` with model settings and further parallel ones (EP, the schedule), validated again."""
    cfg, documents = layout
    cfg.model = replace(cfg.model, **(model or {}))
    for name, value in parallel.items():
        setattr(cfg.parallel, name, value)
    par = cfg.parallel
    validate_config(cfg, world_size=par.tp * par.cp * par.pp * par.dp, check_paths=False)
    return cfg, documents


LAYOUTS = [_layout(MTP, cp=1, tp=2, dp=2, zero_stage=3, domino=True, sequence_parallel=True),
           _with(_layout(MTP, cp=1, pp=2, dp=2), dict(recompute="full")),  # the embedding copied for MTP
           _with(_layout(MTP, cp=1, tp=2, pp=2, domino=True), dict(tie_embeddings=True)),  # MTP reads the tied head
           _layout(MTP, cp=2, dp=2, documents=True),
           _layout(MTP_MOE, cp=1, tp=2, dp=2, domino=True),
           # the tiny DeepSeek-V3 of tests/test_mla.py with one MTP module: ZB-H1, interleaved, EP with Domino and SP
           _with(_layout(DEEPSEEK_MTP, cp=1, pp=2, dp=2), pipeline_schedule="zb-h1"),
           _with(_layout(DEEPSEEK_MTP, cp=1, pp=2, dp=2, virtual_pp=2)),
           _with(_layout(DEEPSEEK_MTP, cp=1, tp=2, dp=2, domino=True, sequence_parallel=True), ep=2)]
EIGHT = [_with(_layout(DEEPSEEK_MTP, cp=1, tp=2, pp=2, dp=2, domino=True), ep=2)]


def _check_all(world_size, layouts):
    """Every loss and weight within 1e-5 of one process; every rank reports the same MTP loss, a positive number."""
    per_rank = run_ranks(_check, world_size, layouts, timeout=600)
    for index in range(len(layouts)):
        assert_covered(index, [rank[0][index][0] for rank in per_rank], per_rank[0][0][index][1])
        values = [rank[1][index] for rank in per_rank]
        assert values[0] > 0 and all(abs(v - values[0]) <= 1e-6 * values[0] for v in values), (index, values)


@pytest.mark.slow
def test_mtp_trains_like_one_process_under_tp_domino_zero3_pipeline_cp_and_moe():
    """4 ranks, 6 SGD steps per layout (LAYOUTS)."""
    _check_all(4, LAYOUTS)


@pytest.mark.slow
def test_tiny_deepseek_v3_with_mtp_trains_like_one_process_on_tp2_pp2_dp2_ep2():
    _check_all(8, EIGHT)


@pytest.mark.quick
@pytest.mark.parametrize("overrides, key", [
    (dict(mtp_num_layers=-1), "model.mtp_num_layers"),
    (dict(mtp_num_layers=16), "model.mtp_num_layers"),  # as long as the sequence
    (dict(mtp_num_layers=1, mtp_loss_scale=0.0), "model.mtp_loss_scale"),
    (dict(mtp_num_layers=1, position_embedding="learned"), "model.mtp_num_layers"),
])
def test_bad_mtp_configs_are_refused(overrides, key):
    cfg, _ = _layout(LLAMA_16, cp=1, dp=2)
    cfg.model = replace(cfg.model, **overrides)
    with pytest.raises(ConfigError) as error:
        validate_config(cfg, world_size=2, check_paths=False)
    assert key in str(error.value)
