"""What the Muon tests share: tiny GPT and Llama configs, Muon's optimizer settings, and the one-process reference
built on torch.optim.Muon (the logical matrices as tensors of their own) and torch.optim.AdamW (the rest).

The reference splits the fused weights itself, independently of ``optim/muon_math.py``: the group-major QKV as
[groups, queries + 2, head dim, hidden] (Q, K and V), SwiGLU's fc1 as its gate and up halves."""
import torch

from megatron_domino.config import ModelConfig
from megatron_domino.config.schema import OptimizerConfig
from megatron_domino.models import LanguageModel, initialize_weights

GPT = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, seq_length=16,
                  vocab_size=200, make_vocab_size_divisible_by=8, bias=False)
LLAMA = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
                    seq_length=16, vocab_size=200, make_vocab_size_divisible_by=8, bias=False, norm="rmsnorm",
                    activation="swiglu", position_embedding="rope", tie_embeddings=False)


def muon_config(**overrides) -> OptimizerConfig:
    """Muon on the matrices, AdamW (its own lr and decay) on the rest, clipping active."""
    return OptimizerConfig(**{"name": "muon", "lr": 0.02, "weight_decay": 0.1, "adamw_lr": 3e-3,
                              "adamw_weight_decay": 0.01, "clip_grad": 0.5, "bucket_size_mb": 0.01, **overrides})


def _matrices(name: str, tensor: torch.Tensor, cfg: ModelConfig, split_qkv: bool) -> list[torch.Tensor]:
    """The logical matrices of a model weight, as views."""
    if name.endswith("qkv.weight") and split_qkv:
        groups, dim = cfg.query_groups, cfg.head_dim
        grouped = tensor.view(groups, cfg.num_attention_heads // groups + 2, dim, cfg.hidden_size)
        return [grouped[:, :-2], grouped[:, -2], grouped[:, -1]]
    if name.endswith("fc1.weight") and cfg.activation == "swiglu":
        return list(tensor.chunk(2))
    return [tensor]


def is_muon(name: str) -> bool:
    return any(name.endswith(end) for end in ("qkv.weight", "proj.weight", "fc1.weight", "fc2.weight"))


class TorchMuonReference:
    """torch.optim.Muon on every logical matrix of a model's weights, torch.optim.AdamW on the rest: ``step`` takes
    the weights and (clipped) gradients of a step and returns the updated weights. bf16 Newton-Schulz rounds a
    last-bit difference of its input into a different update, so the reference steps from the same weights and
    gradients as the run it checks, step after step, its own momenta and moments carried along."""

    def __init__(self, cfg: ModelConfig, opt: OptimizerConfig, seed: int):
        self.cfg, self.opt = cfg, opt
        model = LanguageModel(cfg)
        initialize_weights(model, seed)
        self.params = {name: p.detach().clone() for name, p in model.named_global_parameters()}
        self.leaves = {name: [m.clone().reshape(-1, m.shape[-1]) for m in self._matrices(name, p)]
                       for name, p in self.params.items() if is_muon(name)}
        rule = {"spectral": "original", "moonlight": "match_rms_adamw"}[opt.muon_scale]
        self.muon = torch.optim.Muon([m for ms in self.leaves.values() for m in ms], lr=opt.lr,
                                     weight_decay=opt.weight_decay, momentum=opt.muon_momentum,
                                     nesterov=opt.muon_nesterov, ns_coefficients=tuple(opt.muon_ns_coefficients),
                                     ns_steps=opt.muon_ns_steps, adjust_lr_fn=rule)
        rest = [p for name, p in self.params.items() if not is_muon(name)]
        groups = [{"params": [p for p in rest if p.dim() >= 2], "weight_decay": opt.adamw_weight_decay},
                  {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}]
        self.adamw = torch.optim.AdamW(groups, lr=opt.adamw_lr, betas=(opt.beta1, opt.beta2), eps=opt.eps)

    def _matrices(self, name: str, tensor: torch.Tensor) -> list[torch.Tensor]:
        return _matrices(name, tensor, self.cfg, self.opt.muon_split_qkv)

    @torch.no_grad()
    def step(self, weights: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for name, param in self.params.items():
            param.copy_(weights[name])
            param.grad = grads[name].clone()
            for leaf, value, grad in zip(self.leaves.get(name, []), self._matrices(name, param),
                                         self._matrices(name, param.grad)):
                leaf.copy_(value.reshape(leaf.shape))
                leaf.grad = grad.reshape(leaf.shape).clone()
        self.muon.step()
        self.adamw.step()
        for name, leaves in self.leaves.items():
            for view, leaf in zip(self._matrices(name, self.params[name]), leaves):
                view.copy_(leaf.view(view.shape))
        return {name: p.clone() for name, p in self.params.items()}
