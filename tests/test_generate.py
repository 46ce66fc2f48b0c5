"""Generation in one process: the KV cache gives the logits of a full forward (fp32, 1e-5) with RoPE (Llama-3 and
YaRN scaling), learned positions, grouped-query and latent attention, experts; greedy generation equals
transformers' ``generate(do_sample=False)`` token for token for GPT-2, Llama, Mixtral, Qwen3, Qwen3-MoE and
DeepSeek-V3 converted at tp 2 × pp 2 and loaded at tp 1; sampling is reproducible with a seed and shaped as asked.
The command line, TP and refusals: test_generate_cli.py."""
import os
from dataclasses import replace

import pytest
import torch

from megatron_domino.config import load_config
from megatron_domino.generation.decode import generate, next_logits
from megatron_domino.generation.sampling import Sampling, TokenPicker, sample
from megatron_domino.models import LanguageModel
from megatron_domino.models.init import initialize_weights
from megatron_domino.models.kv_cache import KVCache
from tests.test_convert import _gpt2, _llama, _load_native, _mixtral, _qwen, cli
from tests.test_models_hf import LLAMA
from tests.training_runs import REPO, TINY

transformers = pytest.importorskip("transformers")

PROMPT = [5, 17, 42, 7, 99]


def _tiny(family: str, **changes):
    return replace(load_config(os.path.join(REPO, TINY[family])).model, **changes)


CACHED = {"gpt (learned positions)": _tiny("gpt"), "llama-3 rope scaling, gqa": replace(LLAMA, seq_length=16),
          "mixtral": _tiny("mixtral"), "qwen3-moe (qk-norm)": _tiny("qwen3_moe"),
          "deepseek-v3 (mla, yarn)": _tiny("deepseek_v3")}


@pytest.mark.parametrize("name", CACHED)
@torch.no_grad()
def test_kv_cache_gives_the_logits_of_a_full_forward(name):
    """The prompt in one step, then one token, then three at once (a mask over cached and new keys), then one:
    each step's logits equal the full sequence's at the same positions."""
    cfg = CACHED[name]
    model = LanguageModel(cfg).eval()
    initialize_weights(model, seed=3)
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    full = model.logits(None, {"tokens": tokens, "position_ids": torch.arange(12).expand(2, -1)})
    cache, start = KVCache(12), 0
    for size in (7, 1, 3, 1):
        step = model.logits(None, {"tokens": tokens[:, start:start + size], "kv_cache": cache,
                                   "position_ids": torch.arange(start, start + size).expand(2, -1)})
        cache.advance(size)
        torch.testing.assert_close(step, full[:, start:start + size], rtol=0, atol=1e-5)
        start += size
    assert next_logits(model, tokens[:, :5], KVCache(5)).shape == (2, cfg.vocab_size)
    with pytest.raises(ValueError, match="the KV cache holds 12 tokens"):
        model.logits(None, {"tokens": tokens[:, :1], "kv_cache": cache, "position_ids": torch.full((2, 1), 12)})


def _sharpened(model, factor: float = 10.0):
    """Random models at HF's init give near-uniform logits and repeat one token; larger weights make the greedy
    path varied and its choices clear."""
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.mul_(factor)
    return model


def _deepseek_v3():
    from tests.test_mla import _hf_deepseek
    return _hf_deepseek()


HF_MODELS = {"gpt2": lambda: _sharpened(_gpt2()), "llama": lambda: _sharpened(_llama()), "mixtral": _mixtral,
             "qwen3": lambda: _qwen("qwen3"), "qwen3_moe": lambda: _qwen("qwen3_moe"), "deepseek_v3": _deepseek_v3}


def hf_greedy(hf_model, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy continuation, never stopping early (the tiny configs name an EOS id)."""
    hf_model.generation_config.eos_token_id = None
    hf_model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new_tokens)
    return out[0, len(prompt):].tolist()


def converted(name: str, root, tp: int = 2, pp: int = 2):
    """(HF model, native checkpoint root converted at tp x pp) of the tiny ``name``."""
    hf_model = HF_MODELS[name]().eval()
    hf_dir, native = str(root / f"{name}-hf"), str(root / f"{name}-tp{tp}pp{pp}")
    hf_model.save_pretrained(hf_dir, safe_serialization=True)
    args = ["--seq-length", "16"] if name == "deepseek_v3" else []
    assert cli.main(["hf-to-native", "--model", name, "--input", hf_dir, "--output", native, "--tp", str(tp),
                     "--pp", str(pp), "--quiet", *args]) == 0
    return hf_model, native


@pytest.mark.parametrize("name", HF_MODELS)
def test_greedy_equals_transformers_from_another_layout(name, tmp_path):
    hf_model, native = converted(name, tmp_path, pp=1 if name == "deepseek_v3" else 2)  # its 3 layers: pp 1
    model = _load_native(native, load_config(os.path.join(native, "config.yaml")).model)
    ours = generate(model, PROMPT, 10, TokenPicker(Sampling(), torch.device("cpu"), model.cfg.vocab_size))
    expected = hf_greedy(hf_model, PROMPT, 10)
    assert ours == expected and len(set(expected)) > 2  # a varied path, not one token repeated


def test_generation_stops_after_the_stop_id():
    model = LanguageModel(CACHED["mixtral"]).eval()
    initialize_weights(model, seed=3)
    pick = TokenPicker(Sampling(), torch.device("cpu"), model.cfg.vocab_size)
    free = generate(model, PROMPT, 6, pick)
    assert generate(model, PROMPT, 6, pick, stop_id=free[2]) == free[:free.index(free[2]) + 1]


def test_sampling_is_reproducible_with_a_seed_and_shaped_as_asked():
    logits = torch.randn(500, generator=torch.Generator().manual_seed(1)) * 3

    def draws(sampling, count=200):
        generator = torch.Generator().manual_seed(sampling.seed)
        return [int(sample(logits, sampling, generator)) for _ in range(count)]

    warm = Sampling(temperature=1.0, seed=7)
    assert draws(warm) == draws(warm) and draws(warm) != draws(replace(warm, seed=8))
    assert set(draws(replace(warm, top_k=1))) == {int(logits.argmax())}
    assert set(draws(replace(warm, top_k=5))) <= set(logits.topk(5).indices.tolist())
    probs = logits.softmax(-1).sort(descending=True)
    nucleus = probs.indices[:int((probs.values.cumsum(-1) < 0.6).sum()) + 1].tolist()  # the fewest reaching 0.6
    assert set(draws(replace(warm, top_p=0.6), 400)) == set(nucleus)
    assert set(draws(replace(warm, top_p=1e-6))) == {int(logits.argmax())}
    picker = TokenPicker(warm, torch.device("cpu"), vocab=10)  # ids the tokenizer cannot write are never chosen
    assert all(int(picker(logits)) < 10 for _ in range(50))
