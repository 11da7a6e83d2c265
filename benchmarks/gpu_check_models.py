"""The models of benchmarks/gpu_check.py, as `pyplan partition` and `pyplan run` name them
(`gpu_check_models:llama`, `gpu_check_models:llama_batch`, `gpu_check_models:loss`): Hugging
Face causal LMs built from a config (nothing downloaded), sized by $GPU_CHECK_SIZE:

- gpu: a Llama-3-8B-shaped model of 3 layers (hidden 4096, 32 heads, 8 key/value heads, SwiGLU
  14336, vocabulary 128256) on micro-batches of one 4096-token sequence, a GPT-2-XL-shaped one
  of 4 layers (hidden 1600, 25 heads, vocabulary 50257) on 4 sequences of 1024, and for
  `pyplan run` a GPT-2-small-shaped one of 4 layers on 4 sequences of 512;
- cpu: the same families at width 64, for `gpu_check.py --cpu` and its test; `pyplan run`
  there trains pyplan's example transformer (pyplan.examples.transformer: no transformers to
  import in the worker, and torch.compile traces it in seconds).

Each model's data is a global batch of 2 micro-batches (partition measures one micro-batch).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

__all__ = ["MODELS", "batch_of", "config", "gpt2", "gpt2_batch", "llama", "llama_batch",
           "loss", "run", "run_batch", "size"]

MODELS = {
    "gpu": {
        "llama": dict(family="llama", sequence=4096, micro_batch=1, hf=dict(
            hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
            intermediate_size=14336, num_hidden_layers=3, vocab_size=128256,
            max_position_embeddings=4096)),
        "gpt2": dict(family="gpt2", sequence=1024, micro_batch=4, hf=dict(
            n_embd=1600, n_head=25, n_layer=4, vocab_size=50257, n_positions=1024)),
        "run": dict(family="gpt2", sequence=512, micro_batch=4, hf=dict(
            n_embd=768, n_head=12, n_layer=4, vocab_size=50257, n_positions=512)),
    },
    "cpu": {
        "llama": dict(family="llama", sequence=32, micro_batch=2, hf=dict(
            hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, num_hidden_layers=2, vocab_size=256,
            max_position_embeddings=64)),
        "gpt2": dict(family="gpt2", sequence=32, micro_batch=2, hf=dict(
            n_embd=64, n_head=4, n_layer=2, vocab_size=256, n_positions=64)),
    },
}
MICRO_BATCHES = 2


def size() -> str:
    return os.environ.get("GPU_CHECK_SIZE", "cpu")


def config(name: str):
    """The Hugging Face config of model `name` (llama, gpt2, run) at this size."""
    from transformers import AutoConfig

    spec = MODELS[size()][name]
    extra = {} if spec["family"] == "llama" else dict(resid_pdrop=0.0, embd_pdrop=0.0,
                                                      attn_pdrop=0.0)
    return AutoConfig.for_model(spec["family"], **spec["hf"], **extra)


def _build(name: str):
    from transformers import AutoModelForCausalLM, logging

    logging.set_verbosity_error()
    return AutoModelForCausalLM.from_config(config(name))


def batch_of(name: str, step: int):
    """The global batch of step `step`: MICRO_BATCHES micro-batches of random tokens and their
    next tokens (the same for every step and rank: seeded by the step)."""
    spec = MODELS[size()][name]
    generator = torch.Generator().manual_seed(step)
    drawn = torch.randint(0, spec["hf"]["vocab_size"],
                          (spec["micro_batch"] * MICRO_BATCHES, spec["sequence"] + 1),
                          generator=generator)
    return drawn[:, :-1], drawn[:, 1:]


def loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


def llama():
    return _build("llama")


def gpt2():
    return _build("gpt2")


def run():
    if size() == "cpu":
        from pyplan.examples.transformer import model

        return model()
    return _build("run")


def llama_batch(step: int):
    return batch_of("llama", step)


def gpt2_batch(step: int):
    return batch_of("gpt2", step)


def run_batch(step: int):
    if size() == "cpu":
        from pyplan.examples.transformer import batch

        return batch(step)
    return batch_of("run", step)
