"""The overhead reference: the GPT that megatron_domino trains at tp = pp = dp = 1, in plain PyTorch.

Same math: learned positions, pre-LayerNorm blocks, fused QKV (per head: q, k, v), causal SDPA, GeLU MLP
of 4h, tied output head, fp32 cross entropy; AdamW with decay on matrices only, global-norm clipping.
Nothing here imports megatron_domino; parameter names match its model, so benchmarks/overhead.py loads
the framework's initial weights into this one and checks that both give the same losses step by step.

    python benchmarks/plain_pytorch_gpt.py --steps 10       # standalone: random tokens, mean step time
"""
from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, eps: float):
        super().__init__()
        self.heads = heads
        self.input_norm = nn.LayerNorm(hidden, eps=eps)
        self.attention = nn.Module()
        self.attention.qkv = nn.Linear(hidden, 3 * hidden)
        self.attention.proj = nn.Linear(hidden, hidden)
        self.post_attention_norm = nn.LayerNorm(hidden, eps=eps)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(hidden, 4 * hidden)
        self.mlp.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        qkv = self.attention.qkv(self.input_norm(x)).view(b, s, self.heads, 3, h // self.heads)
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
        context = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.attention.proj(context)
        return x + self.mlp.fc2(F.gelu(self.mlp.fc1(self.post_attention_norm(x))))


class PlainGPT(nn.Module):
    def __init__(self, vocab: int, hidden: int, heads: int, layers: int, seq: int, eps: float = 1e-5,
                 std: float = 0.02):
        super().__init__()
        self.embedding = nn.Module()
        self.embedding.word_embeddings = nn.Embedding(vocab, hidden)
        self.embedding.position_embeddings = nn.Embedding(seq, hidden)
        self.layers = nn.ModuleList(Block(hidden, heads, eps) for _ in range(layers))
        self.final_norm = nn.LayerNorm(hidden, eps=eps)
        for name, param in self.named_parameters():  # GPT-2 init: output projections scaled by depth
            if name.endswith("bias"):
                nn.init.zeros_(param)
            elif param.dim() == 1:
                nn.init.ones_(param)
            else:
                scaled = name.endswith(("proj.weight", "fc2.weight"))
                nn.init.normal_(param, 0.0, std / math.sqrt(2 * layers) if scaled else std)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embedding.word_embeddings(tokens) + self.embedding.position_embeddings(positions)
        for layer in self.layers:
            x = layer(x)
        logits = F.linear(self.final_norm(x), self.embedding.word_embeddings.weight)
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def make_optimizer(model: nn.Module, lr: float, betas, eps: float, weight_decay: float) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=True)


def forward_backward(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    loss = model(tokens, labels)
    loss.backward()
    return loss.detach()


def optimizer_step(model: nn.Module, optimizer: torch.optim.Optimizer, clip: float) -> float:
    norm = nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (("vocab", 1024), ("hidden", 512), ("heads", 8), ("layers", 4), ("seq", 256),
                          ("batch", 8), ("steps", 10), ("threads", 1)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = PlainGPT(args.vocab, args.hidden, args.heads, args.layers, args.seq)
    optimizer = make_optimizer(model, 3e-3, (0.9, 0.95), 1e-8, 0.1)
    times = []
    for step in range(args.steps):
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1))
        start = time.perf_counter()
        loss = forward_backward(model, tokens[:, :-1], tokens[:, 1:]).item()
        optimizer_step(model, optimizer, 1.0)
        times.append(time.perf_counter() - start)
        print(f"step {step + 1}: loss {loss:.4f}, {times[-1] * 1e3:.1f} ms", flush=True)
    print(f"mean step time after the first: {sum(times[1:]) / max(1, len(times) - 1) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
