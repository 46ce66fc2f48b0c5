"""DeepSeek-V3's multi-token prediction against an independent one-process reference, layer by layer.

transformers never runs the MTP module, and a round trip of its weights is symmetric (swapping ``enorm`` and
``hnorm`` in the conversion passed every other test), so the reference is written here from DeepSeek-V3's
definition as the hub's weights are run by its inference engines (vLLM's and SGLang's ``deepseek_mtp``): for
position t, h' = eh_proj([enorm(embedding of token t + 1); hnorm(h_t)]), where h_t is the main model's last hidden
state before its final norm (the paper writes the concatenation the other way round; the weights follow the
code), then DeepSeek-V3's decoder layer ``num_hidden_layers`` on h' (transformers' own ``DeepseekV3DecoderLayer``,
MoE with its score bias), ``shared_head.norm`` and ``shared_head.head`` (the main model's head), predicting token
t + 2. A sharpened tiny DeepSeek-V3 of 4 layers is saved as the hub stores one with an MTP module (3 layers, the
4th as ``model.layers.3`` with the module's norms and projection), converted by tools/convert_checkpoint.py and
compared stage by stage: each main layer, the main logits, the two norms, the projection, the block and the MTP loss;
then converted back to the hub's files, bit for bit."""
import json
import os

import pytest
import torch
import torch.nn.functional as F

from megatron_domino.config import load_config
from megatron_domino.models.mtp import with_mtp_targets
from tests.hf_sharp import assert_logits_close, sharpen

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.quick
TOL = 8e-6  # of the largest value of each stage: ten times the most measured (fp32, 7.9e-7, the block)


def _hub_model(directory: str):
    """(the 4-layer HF model in memory, its MTP module's own tensors); the directory holds it as the hub stores a
    3-layer DeepSeek-V3 with one MTP module."""
    from safetensors.torch import load_file, save_file

    from tests.test_mla import _hf_deepseek
    config = _hf_deepseek().config
    config.num_hidden_layers = 4
    torch.manual_seed(7)
    model = sharpen(transformers.DeepseekV3ForCausalLM(config).eval(), seed=17)
    model.save_pretrained(directory, safe_serialization=True)
    (weights_file,) = [name for name in os.listdir(directory) if name.endswith(".safetensors")]
    tensors = load_file(os.path.join(directory, weights_file))
    h, g = config.hidden_size, torch.Generator().manual_seed(8)
    own = {"enorm.weight": 1 + 0.3 * torch.randn(h, generator=g), "hnorm.weight": 1 + 0.3 * torch.randn(h, generator=g),
           "eh_proj.weight": torch.randn(h, 2 * h, generator=g) * (2 * h) ** -0.5,
           "shared_head.norm.weight": 1 + 0.3 * torch.randn(h, generator=g)}
    extra = {f"model.layers.3.{name}": tensor for name, tensor in own.items()}
    extra.update({"model.layers.3.embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
                  "model.layers.3.shared_head.head.weight": tensors["lm_head.weight"].clone()})
    save_file({**tensors, **extra}, os.path.join(directory, weights_file), metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json")) as f:
        saved = json.load(f)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(dict(saved, num_hidden_layers=3, num_nextn_predict_layers=1), f)
    return model, own


def _reference(model, own, tokens):
    """Every stage of the main model and the MTP module, from transformers' modules and the definition above."""
    from transformers.masking_utils import create_causal_mask
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm
    body, config = model.model, model.config
    stages = {}

    def run(layers, hidden):
        positions = torch.arange(hidden.shape[1]).unsqueeze(0)
        mask = create_causal_mask(config=config, inputs_embeds=hidden, attention_mask=None, cache=None,
                                  position_ids=positions)
        rope = body.rotary_emb(hidden, positions)
        outputs = []
        for layer in layers:
            hidden = layer(hidden, position_embeddings=rope, attention_mask=mask, position_ids=positions)
            outputs.append(hidden)
        return outputs

    with torch.no_grad():
        main = run(body.layers[:3], body.embed_tokens(tokens[:, :-1]))
        stages.update({f"layer {i}": out for i, out in enumerate(main)})
        stages["logits"] = model.lm_head(body.norm(main[-1]))
        norms = {}
        for name in ("enorm", "hnorm", "shared_head.norm"):
            norms[name] = DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            norms[name].weight.copy_(own[f"{name}.weight"])
        # position t (t < s - 1): the embedding of token t + 1 and the main hidden state at t
        stages["embedding norm"] = norms["enorm"](body.embed_tokens(tokens[:, 1:-1]))
        stages["hidden norm"] = norms["hnorm"](main[-1][:, :-1])
        stages["projection"] = F.linear(torch.cat([stages["embedding norm"], stages["hidden norm"]], dim=-1),
                                        own["eh_proj.weight"])
        (stages["block"],) = run(body.layers[3:], stages["projection"])
        logits = model.lm_head(norms["shared_head.norm"](stages["block"]))
        stages["loss"] = F.cross_entropy(logits.flatten(0, 1), tokens[:, 2:].flatten(), reduction="none").view(
            logits.shape[:2])
    return stages


def _ours(model, tokens):
    """The same stages of the converted native model (forward hooks), cut to the positions the reference has."""
    stages, hooks = {}, []

    def keep(name, cut=None):
        def hook(module, args, output):
            stages[name] = output if cut is None else output[:, :cut]
        return hook

    s = tokens.shape[1] - 1
    for i, layer in enumerate(model.layers):
        hooks.append(layer.register_forward_hook(keep(f"layer {i}")))
    mtp = model.mtp.layers[0]
    for module, name in ((mtp.embedding_norm, "embedding norm"), (mtp.hidden_norm, "hidden norm"),
                         (mtp.block, "block")):
        hooks.append(module.register_forward_hook(keep(name, s - 1)))
    hooks.append(mtp.block.register_forward_pre_hook(lambda module, args: stages.update(projection=args[0][:, :s - 1])))
    batch = with_mtp_targets({"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}, 1)
    with torch.no_grad():
        per_token = model(None, batch)
        for hook in hooks:
            hook.remove()
        stages["logits"] = model.logits(None, {"tokens": tokens[:, :-1]})
    stages["loss"] = per_token[:, :s - 1, 1]
    return stages


def test_mtp_equals_the_definition_stage_by_stage_and_converts_back_bit_exact(tmp_path):
    """Then the export writes every tensor of the hub's directory back, bit for bit, and says it holds MTP."""
    from tests.test_convert import _hf_tensors, _load_native, cli
    hub, native = str(tmp_path / "hub"), str(tmp_path / "native")
    hf_model, own = _hub_model(hub)
    assert cli.main(["hf-to-native", "--model", "deepseek_v3", "--input", hub, "--output", native, "--seq-length",
                     "16", "--quiet"]) == 0
    cfg = load_config(os.path.join(native, "config.yaml"))
    assert cfg.model.mtp_num_layers == 1 and cfg.model.num_layers == 3
    model = _load_native(native, cfg.model)
    tokens = torch.randint(0, hf_model.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(9))
    want, got = _reference(hf_model, own, tokens), _ours(model, tokens)
    assert list(got) == ["layer 0", "layer 1", "layer 2", "embedding norm", "hidden norm", "projection", "block",
                         "logits", "loss"] and set(got) == set(want)
    assert_logits_close(got.pop("logits"), want.pop("logits"))
    for name, expected in want.items():
        error = ((got[name] - expected).abs().max() / expected.abs().max()).item()
        assert error <= TOL, f"{name}: {error:.2e} of the largest apart"
    assert want["loss"].mean() > 1  # a sharp model's loss, not a near-uniform one
    back = str(tmp_path / "back")
    assert cli.main(["native-to-hf", "--input", native, "--output", back, "--quiet"]) == 0
    exported, original = _hf_tensors(back), _hf_tensors(hub)
    assert set(exported) == set(original)
    assert all(torch.equal(exported[name], tensor) for name, tensor in original.items())
    with open(os.path.join(back, "config.json")) as f:
        assert json.load(f)["num_nextn_predict_layers"] == 1
    assert transformers.AutoConfig.from_pretrained(back).num_nextn_predict_layers == 1
