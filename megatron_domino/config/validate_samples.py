"""The rules of the ``eval`` section's samples (``eval.sample_prompts``, ``eval.sample_tokens``;
``training/samples.py``)."""
from __future__ import annotations

from .checks import Checks


def check_samples(c: Checks, cfg) -> None:
    e, m = cfg.eval, cfg.model
    if not c.positive("eval.sample_tokens", e.sample_tokens) or not e.sample_prompts:
        return
    empty = [i for i, prompt in enumerate(e.sample_prompts) if not prompt.strip()]
    if empty:
        c.fail(f"eval.sample_prompts[{empty[0]}]", e.sample_prompts[empty[0]], "is empty: a sample continues a text",
               "give every prompt some text, or drop it")
    if cfg.tokenizer.type == "NullTokenizer":
        c.fail("eval.sample_prompts", e.sample_prompts, "are texts, and tokenizer.type = NullTokenizer reads none",
               "set tokenizer.type and its files (the tokenizer the data was made with), or eval.sample_prompts=[]")
    if m.position_embedding == "learned" and e.sample_tokens >= m.max_positions:
        c.fail("eval.sample_tokens", e.sample_tokens, f"leaves no room for the prompt in the learned position table "
               f"(model.max_position_embeddings = {m.max_positions})",
               f"ask for fewer than {m.max_positions} tokens")
    if cfg.parallel.cp > 1:
        c.warnings.append("eval.sample_prompts: no samples are drawn under parallel.cp > 1 (context parallelism "
                          "splits the training sequence; samples run whole sequences)")
