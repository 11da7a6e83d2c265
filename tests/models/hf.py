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
# Every family tried: the tests cut each and train it on 2 ranks against one process.
ALL = FAMILIES + HYBRIDS + ("jamba", "zamba2")


# What a family needs beyond the common sizes to build at width 32 (its config checks that
# its Mamba heads, latent ranks or layer kinds fit) and to mix its layer kinds in 4 layers.
MAMBA = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=8)
LATENT = dict(kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
              v_head_dim=16, moe_intermediate_size=32, n_group=1, topk_group=1,
              num_experts_per_tok=2, first_k_dense_replace=1)
MIXED = ["linear_attention", "full_attention"] * 2
SPECIFIC = {
    "mamba2": dict(num_heads=4, head_dim=16, state_size=16, n_groups=1, chunk_size=8),
    "bamba": dict(MAMBA, attn_layer_indices=[1, 3]),
    "granitemoehybrid": dict(MAMBA, layer_types=MIXED, num_local_experts=4,
                             shared_intermediate_size=32),
    "nemotron_h": dict(layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
                       ssm_state_size=16, mamba_num_heads=4, mamba_head_dim=16, n_groups=1,
                       chunk_size=8, n_routed_experts=4, moe_intermediate_size=32,
                       moe_shared_expert_intermediate_size=32),
    "deepseek_v3": dict(LATENT, n_routed_experts=4, head_dim=8),
    "falcon_h1": dict(MAMBA, mamba_d_ssm=64),
    "qwen3_next": dict(linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
                       linear_value_head_dim=16),
    "bailing_hybrid": dict(LATENT, q_lora_rank=None, layer_types=MIXED,
                           mlp_layer_types=["dense", "sparse"] * 2, num_local_experts=4),
    "kimi_linear": dict(LATENT, q_lora_rank=None, layer_types=MIXED,
                        mlp_layer_types=["dense", "sparse"] * 2, num_local_experts=4,
                        linear_head_dim=16, linear_num_heads=2),
    "olmo_hybrid": dict(linear_num_key_heads=2, linear_num_value_heads=8,
                        linear_key_head_dim=16, linear_value_head_dim=8),
    # Jamba's layer list mixes classes: Mamba layers, and attention in every second one.
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, num_experts=2, mamba_dt_rank=8),
    # Zamba2 alternates Mamba layers and hybrid ones, whose shared attention block (one module
    # in several layers) also reads the embeddings' output.
    "zamba2": dict(layers_block_type=["mamba", "hybrid"] * 2, attention_head_dim=16,
                   mamba_d_state=8, mamba_headdim=8, n_mamba_heads=8, mamba_ngroups=1),
}


def config(family: str, **changes):
    """A tiny config of `family` (4 layers, width 32), with `changes` (keys the family does not
    have are left out); built through the family's own config class, so what it derives from
    these sizes (layer kinds, head sizes) follows them and its checks hold."""
    small = dict(num_hidden_layers=4, hidden_size=32, num_attention_heads=2,
                 num_key_value_heads=1, intermediate_size=64, vocab_size=VOCAB, head_dim=16,
                 n_layer=4, n_embd=32, n_head=2, ffn_dim=64, word_embed_proj_dim=32,
                 num_layers=4, attention_types=[[["global", "local"], 2]], window_size=8,
                 rotary_dim=8,
                 pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=64,
                 n_positions=64, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                 shared_intermediate_size=32, num_local_experts=4, num_experts=4,
                 num_experts_per_tok=2)
    default = AutoConfig.for_model(family)
    wanted = {**small, **SPECIFIC.get(family, {}), **changes}
    return AutoConfig.for_model(family, **{k: v for k, v in wanted.items()
                                           if hasattr(default, k) and _settable(default, k)})


def _settable(config, key: str) -> bool:
    """Whether `key` is a setting of `config` rather than a value it derives (a property
    without a setter: Falcon's head_dim)."""
    found = getattr(type(config), key, None)
    return not isinstance(found, property) or found.fset is not None


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
    return build("jamba")


def zamba2():
    return build("zamba2")


def __getattr__(name: str):
    """`hf:FAMILY` names the factory of any family of ALL (its tiny config)."""
    if name in ALL:
        return lambda: build(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def tokens(vocab: int, sequence: int, size: int):
    """`size` random sequences of `sequence` tokens (ids 3 and up: 0-2 are pad, bos and eos) and
    their labels, the next tokens."""
    drawn = torch.randint(3, vocab, (size, sequence + 1))
    return drawn[:, :-1], drawn[:, 1:]


def batch(step: int):
    return tokens(VOCAB, SEQUENCE, BATCH)


def loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def transformers_quiet() -> None:
    """transformers' notices (kernels it falls back from, config checks) off."""
    import transformers

    transformers.logging.set_verbosity_error()
