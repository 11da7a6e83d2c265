"""Hugging Face causal LMs as users build them (from a config, nothing downloaded), for
`pyplan partition`: a factory per family, the batch and the loss. The factories are the only
model code: no per-model adapter. Tiny here (4 layers, width 32) for the tests;
benchmarks/hf_models.py builds larger ones from the same `config`, the one place that sizes a
family's config."""

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB, SEQUENCE, BATCH = 128, 16, 8
FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text",
            "phi3", "phi", "opt", "gpt_neox", "falcon", "bloom", "gptj", "gpt_neo",
            "gpt_bigcode", "olmo2", "starcoder2", "granite", "cohere", "mixtral", "qwen3_moe",
            "smollm3", "mamba")
# Families whose `_init_weights` derives a parameter from its own value (`p.copy_(f(p))`:
# Mamba's A_log and dt_bias, Nemotron-H's scaled out_proj) or that mix layer kinds.
HYBRIDS = ("mamba2", "nemotron_h", "bamba", "falcon_h1", "olmo_hybrid", "bailing_hybrid",
           "kimi_linear", "qwen3_next", "lfm2", "minimax", "granitemoehybrid", "deepseek_v3",
           "gpt_oss", "olmo3", "glm4", "cohere2", "exaone4", "ernie4_5", "seed_oss")


def config(family: str, **changes):
    """A tiny config of `family` (4 layers, width 32), with `changes` (keys the family does not
    have are left out)."""
    small = dict(num_hidden_layers=4, hidden_size=32, num_attention_heads=2,
                 num_key_value_heads=1, intermediate_size=64, vocab_size=VOCAB, head_dim=16,
                 n_layer=4, n_embd=32, n_head=2, ffn_dim=64, word_embed_proj_dim=32,
                 num_layers=4, attention_types=[[["global", "local"], 2]], window_size=8,
                 rotary_dim=8,
                 pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=64,
                 n_positions=64)
    cfg = AutoConfig.for_model(family)
    for key, value in {**small, **changes}.items():
        if hasattr(cfg, key):
            try:
                setattr(cfg, key, value)
            except AttributeError:  # derived from the others in this family (head_dim)
                pass
    return cfg


def build(family: str, **changes):
    return AutoModelForCausalLM.from_config(config(family, **changes))


def gpt2():
    """GPT-2 ties its input and output embeddings (by default, as here)."""
    return build("gpt2")


def gpt2_untied():
    return build("gpt2", tie_word_embeddings=False)


def llama():
    return build("llama")


def qwen3():
    return build("qwen3")


def gemma():
    return build("gemma")


def jamba():
    """Jamba's layer list mixes classes: Mamba layers, and attention in every second one."""
    return build("jamba", attn_layer_period=2, attn_layer_offset=1, num_experts=2)


def zamba2():
    """Zamba2 alternates Mamba layers and hybrid ones, whose shared attention block (one
    module in several layers) also reads the embeddings' output."""
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "zamba2", num_hidden_layers=4, layers_block_type=["mamba", "hybrid"] * 2,
        hidden_size=32, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
        attention_head_dim=16, mamba_d_state=8, mamba_headdim=8, n_mamba_heads=8,
        mamba_ngroups=1, vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0,
        bos_token_id=1, eos_token_id=2))


def tokens(vocab: int, sequence: int, size: int):
    """`size` random sequences of `sequence` tokens (ids 3 and up: 0-2 are pad, bos and eos) and
    their labels, the next tokens."""
    drawn = torch.randint(3, vocab, (size, sequence + 1))
    return drawn[:, :-1], drawn[:, 1:]


def batch(step: int):
    return tokens(VOCAB, SEQUENCE, BATCH)


def loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
