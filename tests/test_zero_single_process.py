"""The ZeRO optimizer's single-process checks: the bucket layout, misuse refused, chunks stepping as one model."""
import pytest
import torch

from megatron_domino.config import ModelConfig
from megatron_domino.config.errors import ConfigError
from megatron_domino.models import LanguageModel, initialize_weights
from megatron_domino.optim.distributed_optimizer import DistributedOptimizer
from megatron_domino.optim.buckets import ALIGN, plan_buckets
from tests.zero_setup import (CFG, LR, SEED, TOKENS, assert_rel, batches, loss_of, new_model, optimizer_config,
                               reference_optimizer)


def test_bucket_layout_is_aligned_and_embeddings_sit_alone():
    params = [torch.empty(n) for n in (300, 5000, 70, 4000, 10, 2000)]
    embedding = params[3]
    for shards in (1, 2, 4):
        layouts = plan_buckets(params, 3000, shards, alone=lambda p: p is embedding)
        assert [id(p) for layout in layouts for p in layout.params] == [id(p) for p in params]
        for layout in layouts:
            assert layout.size % (shards * ALIGN) == 0
            assert layout.offsets == [sum(p.numel() for p in layout.params[:i]) for i in range(len(layout.params))]
            assert layout.size >= sum(p.numel() for p in layout.params)
        alone = [layout for layout in layouts if any(p is embedding for p in layout.params)]
        assert len(alone) == 1 and alone[0].params[0] is embedding and alone[0].offsets == [0]
        # the embedding's bucket does not depend on its neighbours (first vs last pipeline stage)
        other = plan_buckets([torch.empty(7), embedding], 3000, shards, alone=lambda p: p is embedding)
        assert other[-1].params[0] is embedding and other[-1].offsets == [0] and other[-1].size == alone[0].size


def test_second_gradient_after_bucket_ready_is_an_error():
    model = new_model()
    dopt = DistributedOptimizer([model], optimizer_config(zero_stage=0), dp_group=None, tp_rank=0, norm_groups=[])
    tokens, labels = batches(1)[0]
    dopt.zero_grad()
    dopt.begin_backward(True)
    loss_of(model, tokens[:1], labels[:1]).backward()
    with pytest.raises(RuntimeError, match="second gradient"):
        loss_of(model, tokens[:1], labels[:1]).backward()


def test_invalid_zero_stage_is_a_config_error():
    with pytest.raises(ConfigError, match="optimizer.zero_stage"):
        DistributedOptimizer([new_model()], optimizer_config(zero_stage=4), dp_group=None, tp_rank=0, norm_groups=[])


def test_two_model_chunks_step_like_one_model():
    """Virtual pipeline stages on one rank: one buffer per chunk, one optimizer over both."""
    cfg = ModelConfig(**{**CFG.__dict__, "tie_embeddings": False})
    chunks = [LanguageModel(cfg, layer_ids=[0], has_head=False),
              LanguageModel(cfg, layer_ids=[1], has_embedding=False)]
    whole = LanguageModel(cfg)
    for model in chunks + [whole]:
        initialize_weights(model, SEED)
    opt = optimizer_config(zero_stage=0)
    dopt = DistributedOptimizer(chunks, opt, dp_group=None, tp_rank=0, norm_groups=[])
    assert len(dopt.buffers) == 2
    params = list(whole.parameters())
    reference_opt = reference_optimizer(params, opt)
    for tokens, labels in batches(3):
        batch = {"tokens": tokens, "labels": labels}
        dopt.zero_grad()
        (chunks[1](chunks[0](None, batch), batch).sum() / TOKENS).backward()
        dopt.finish_grad_sync()
        norm = dopt.step(LR)[1]
        reference_opt.zero_grad()
        (whole(None, batch).sum() / TOKENS).backward()
        assert abs(norm - torch.nn.utils.clip_grad_norm_(params, opt.clip_grad).item()) <= 1e-6 * norm
        reference_opt.step()
    expected = dict(whole.named_global_parameters())
    for chunk in chunks:
        for name, param in chunk.named_global_parameters():
            assert_rel(param.detach(), expected[name].detach(), f"chunked {name}", 1e-6)
