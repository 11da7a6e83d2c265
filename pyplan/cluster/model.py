"""A transformer's shape, read from its Hugging Face config: what `pyplan plan` costs.

Only sizes matter here (no weights, no network): layers, hidden size, heads and key/value
heads, the MLP's width and whether it is gated (SwiGLU: three matrices), the vocabulary,
learned position embeddings, tied embeddings, and for a mixture of experts the routed experts,
how many each token visits, their width, shared experts and which layers have them. Families
are told apart by their config's `model_type`; a family whose layers are not a standard
attention + MLP block (multi-head latent attention, state-space layers) is refused by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pyplan.errors import PlanError

__all__ = ["FAMILIES", "Transformer", "from_config", "read_model"]

# model_type -> (gated MLP, norm, biases in the linear layers)
FAMILIES = {
    "gpt2": (False, "layernorm", True), "gpt_bigcode": (False, "layernorm", True),
    "gpt_neox": (False, "layernorm", True), "gptj": (False, "layernorm", True),
    "gpt_neo": (False, "layernorm", True), "opt": (False, "layernorm", True),
    "bloom": (False, "layernorm", True), "falcon": (False, "layernorm", False),
    "starcoder2": (False, "layernorm", True), "phi": (False, "layernorm", True),
    "llama": (True, "rmsnorm", False), "mistral": (True, "rmsnorm", False),
    "qwen2": (True, "rmsnorm", False), "qwen3": (True, "rmsnorm", False),
    "gemma": (True, "rmsnorm", False), "gemma2": (True, "rmsnorm", False),
    "gemma3_text": (True, "rmsnorm", False), "phi3": (True, "rmsnorm", False),
    "olmo": (True, "layernorm", False), "olmo2": (True, "rmsnorm", False),
    "granite": (True, "rmsnorm", False), "cohere": (True, "layernorm", False),
    "smollm3": (True, "rmsnorm", False), "internlm2": (True, "rmsnorm", False),
    "mixtral": (True, "rmsnorm", False), "qwen2_moe": (True, "rmsnorm", False),
    "qwen3_moe": (True, "rmsnorm", False), "olmoe": (True, "rmsnorm", False),
    "granitemoe": (True, "rmsnorm", False), "phimoe": (True, "layernorm", False),
    # NVIDIA's Nemotron(-4): a squared-ReLU MLP of two matrices, LayerNorm; xAI's Grok-1 (the
    # config of its Hugging Face port, whose modelling code is the repository's own): a
    # GeLU-gated mixture of 8 experts, top 2
    "nemotron": (False, "layernorm", False), "grok-1": (True, "rmsnorm", False),
}
_NOT_STANDARD = {
    "deepseek_v2": "multi-head latent attention", "deepseek_v3": "multi-head latent attention",
    "mamba": "state-space layers", "mamba2": "state-space layers", "jamba": "state-space layers",
    "zamba2": "state-space layers", "bamba": "state-space layers",
    "falcon_h1": "state-space layers", "nemotron_h": "state-space layers",
}


@dataclass(frozen=True)
class Transformer:
    """A decoder-only transformer's sizes (one layer kind, possibly with experts)."""

    family: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    """The dense MLP's inner width (a gated MLP has two matrices of it in, one out)."""
    vocab: int
    gated: bool = False
    norm: str = "layernorm"
    biases: bool = True
    tied: bool = False
    positions: int = 0
    """Learned position embeddings (GPT-2's wpe); 0 with rotary or ALiBi."""
    alibi: bool = False
    """Positions as a bias on the attention scores (BLOOM, MPT, Falcon's alibi), added inside
    the attention kernel: no rotary on the queries and keys."""
    dropout: bool = False
    experts: int = 0
    """Routed experts in each MoE layer (0: a dense model)."""
    top_k: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0
    """The shared experts' total inner width, in every MoE layer."""
    moe_layers: int = 0
    """How many of the layers have experts (the others a dense MLP of `ffn`)."""

    @property
    def rotary(self) -> bool:
        return self.positions == 0 and not self.alibi

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def mlp_params(self, width: int) -> int:
        biases = (width * (2 if self.gated else 1) + self.hidden) if self.biases else 0
        return self.hidden * width * (3 if self.gated else 2) + biases

    def attention_params(self) -> int:
        biases = (self.q_dim + 2 * self.kv_dim + self.hidden) if self.biases else 0
        return self.hidden * (self.q_dim + 2 * self.kv_dim) + self.q_dim * self.hidden + biases

    def norm_params(self) -> int:
        return (2 if self.norm == "layernorm" else 1) * self.hidden

    def layer_params(self, moe: bool) -> int:
        """One layer's parameters (an MoE layer: every expert's)."""
        if not moe:
            mlp = self.mlp_params(self.ffn)
        else:
            mlp = self.experts * self.mlp_params(self.expert_ffn) + self.hidden * self.experts
            mlp += self.mlp_params(self.shared_ffn) if self.shared_ffn else 0
        return self.attention_params() + mlp + 2 * self.norm_params()

    def layer_active_params(self, moe: bool) -> int:
        """The parameters one token passes through in a layer (its top-k experts only)."""
        if not moe:
            return self.layer_params(False)
        mlp = self.top_k * self.mlp_params(self.expert_ffn) + self.hidden * self.experts
        mlp += self.mlp_params(self.shared_ffn) if self.shared_ffn else 0
        return self.attention_params() + mlp + 2 * self.norm_params()

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden + self.positions * self.hidden

    @property
    def head_params(self) -> int:
        """The output projection (none of its own when tied) and the final norm."""
        return (0 if self.tied else self.vocab * self.hidden) + self.norm_params()

    def is_moe(self, layer: int) -> bool:
        """Whether layer `layer` (0-based) has experts: the last `moe_layers` of them (the
        dense ones come first, as DeepSeek's and Qwen's `first_k_dense`)."""
        return layer >= self.layers - self.moe_layers

    @property
    def params(self) -> int:
        return (self.embedding_params + self.head_params +
                sum(self.layer_params(self.is_moe(i)) for i in range(self.layers)))

    @property
    def active_params(self) -> int:
        """Parameters a token uses (MoE: top-k experts), embeddings included."""
        return (self.embedding_params + self.head_params +
                sum(self.layer_active_params(self.is_moe(i)) for i in range(self.layers)))

    def model_flops(self, tokens_per_sequence: int) -> float:
        """Model FLOPs per token of training (forward and backward, no recomputation): the
        matmuls with weights, 6 per active weight (embedding lookups excluded, the output
        projection included), plus attention's two s x s products, 12 * layers * q_dim * s
        (the whole s x s, as Megatron-LM's and PaLM's MFU count it, causal or not)."""
        weights = (sum(self.layer_active_params(self.is_moe(i)) for i in range(self.layers))
                   + self.vocab * self.hidden)
        return 6.0 * weights + 12.0 * self.layers * self.q_dim * tokens_per_sequence


def _known(family, where: str) -> None:
    if family in _NOT_STANDARD:
        raise PlanError(f"{where}: model_type {family!r} has {_NOT_STANDARD[family]}, which "
                        "pyplan plan does not cost yet",
                        hint="supported: " + ", ".join(sorted(FAMILIES)))
    if family not in FAMILIES:
        shown = repr(family) if len(repr(family)) <= 60 else repr(family)[:57] + "..."
        raise PlanError(f"{where}: model_type {shown} is not a family pyplan plan knows",
                        hint="supported: " + ", ".join(sorted(FAMILIES)))


def _first(config: dict, *names, default=None):
    for name in names:
        value = config.get(name)
        if value is not None:
            return value
    return default


def from_config(config: dict, where: str = "config.json") -> Transformer:
    """The shape from a config's dict (`PretrainedConfig.to_dict()` or the JSON file)."""
    family = config.get("model_type")
    _known(family, where)
    gated, norm, biases = FAMILIES[family]
    hidden = _first(config, "hidden_size", "n_embd", "d_model")
    layers = _first(config, "num_hidden_layers", "n_layer", "num_layers")
    heads = _first(config, "num_attention_heads", "n_head")
    for name, value in (("hidden_size", hidden), ("num_hidden_layers", layers),
                        ("num_attention_heads", heads)):
        _whole(where, name, value, 1)
    kv_heads = _first(config, "num_key_value_heads", "num_kv_heads", default=heads)
    if family == "falcon" and not config.get("new_decoder_architecture") and \
            config.get("multi_query", True):
        kv_heads = 1
    if family == "gpt_bigcode" and config.get("multi_query", True):
        kv_heads = 1
    head_dim = _first(config, "head_dim") or hidden // heads
    ffn = _first(config, "intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size",
                 default=4 * hidden)
    if family == "gpt_neox" and not config.get("intermediate_size"):
        ffn = 4 * hidden
    vocab = _first(config, "vocab_size")
    experts = _first(config, "num_local_experts", "num_experts", "n_routed_experts", default=0)
    top_k = _first(config, "num_experts_per_tok", "moe_top_k", default=0) if experts else 0
    expert_ffn = _first(config, "moe_intermediate_size", default=ffn) if experts else 0
    shared = _first(config, "shared_expert_intermediate_size", default=0) if experts else 0
    for name, value in (("the number of experts", experts), ("experts per token", top_k),
                        ("the experts' intermediate size", expert_ffn),
                        ("the shared expert's intermediate size", shared),
                        ("positions", positions_of(config, family))):
        _whole(where, name, value, 0)
    if experts and not 1 <= top_k <= experts:
        raise PlanError(f"{where}: {top_k} experts per token of {experts} experts",
                        hint="num_experts_per_tok is between 1 and the number of experts")
    moe_layers = 0
    if experts:
        step = _whole(where, "decoder_sparse_step", config.get("decoder_sparse_step") or 1, 1)
        dense = config.get("mlp_only_layers") or ()
        if not isinstance(dense, (list, tuple)) or not all(type(i) is int for i in dense):
            raise PlanError(f"{where}: mlp_only_layers must list layer numbers",
                            hint="give the model's config.json as transformers writes it")
        dense = set(dense)
        moe_layers = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
    dropout = any(float(config.get(k) or 0) > 0 for k in
                  ("resid_pdrop", "attn_pdrop", "hidden_dropout", "attention_dropout",
                   "dropout", "hidden_dropout_prob"))
    positions = positions_of(config, family)
    model = Transformer(family=family, layers=layers, hidden=hidden, heads=heads,
                        kv_heads=kv_heads, head_dim=head_dim, ffn=ffn, vocab=vocab,
                        gated=gated, norm=norm, biases=biases,
                        tied=bool(config.get("tie_word_embeddings", family == "gpt2")),
                        positions=positions,
                        alibi=family == "bloom" or bool(config.get("alibi")),
                        dropout=dropout, experts=experts, top_k=top_k,
                        expert_ffn=expert_ffn, shared_ffn=shared, moe_layers=moe_layers)
    for name in ("vocab", "ffn", "head_dim", "kv_heads"):
        _whole(where, f"the model's {name}", getattr(model, name), 1)
    if heads % kv_heads:
        raise PlanError(f"{where}: {heads} attention heads do not group into {kv_heads} "
                        "key/value heads")
    return model


MAX_LAYERS = 100_000  # far above any model's; the costs loop over the layers
MAX_SIZE = 2**40       # a width, a vocabulary, a count of experts: far above any model's


def positions_of(config: dict, family: str):
    """Learned position embeddings' count (the families that have them), else 0."""
    return _first(config, "n_positions", "max_position_embeddings", default=0) \
        if family in ("gpt2", "gpt_bigcode", "opt", "gpt_neo") else 0


def _whole(where: str, name: str, value, low: int) -> int:
    """`value` if it is an integer from `low` to its ceiling, else PlanError naming it."""
    high = MAX_LAYERS if "layers" in name else MAX_SIZE
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise PlanError(f"{where}: {name} must be an integer from {low} to {high:,}, got "
                        f"{value!r}", hint="give the model's config.json as transformers "
                        "writes it")
    return value


def read_model(path: str | Path) -> Transformer:
    """A config.json (or a folder holding one), read with transformers' AutoConfig (which
    fills each family's defaults); nothing is downloaded."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise PlanError(f"{file}: no such file", hint="give a model's config.json, or the "
                        "folder of a Hugging Face checkpoint", file=str(file), line=1, column=1)
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        line = getattr(exc, "lineno", 1)
        column = getattr(exc, "colno", 1)
        raise PlanError(f"{file} is not a JSON config: {exc}".splitlines()[0],
                        hint="give a model's config.json", file=str(file), line=line,
                        column=column) from None
    if not isinstance(raw, dict) or not isinstance(raw.get("model_type"), str):
        raise PlanError(f"{file} has no model_type", hint="a Hugging Face config.json names "
                        "its family in model_type", file=str(file), line=1, column=1)
    _known(raw["model_type"], str(file))  # (transformers' refusal lists all its ~900)
    config = _auto_config(raw, file)
    return from_config(config, str(file))


def _auto_config(raw: dict, file: Path) -> dict:
    """The config with its family's defaults filled in by transformers, when it is there and
    knows the family; the raw file otherwise."""
    try:
        from transformers import AutoConfig
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    except ImportError:
        return raw
    if raw["model_type"] not in CONFIG_MAPPING:  # (Grok-1's port: its config is its own)
        return raw
    import logging
    import warnings

    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = AutoConfig.for_model(**raw)
    except Exception as exc:  # noqa: BLE001 - a family's config class refuses in its own way
        # (huggingface_hub's strict dataclasses: a field of the wrong type, on two lines)
        said = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        if len(said) > 300:
            said = said[:297] + "..."
        raise PlanError(f"{file}: transformers cannot read this config: {said}",
                        hint="give a model's config.json as transformers writes it",
                        file=str(file), line=1, column=1) from None
    return {**config.to_dict(), "model_type": raw["model_type"]}


def gpt(layers: int, hidden: int, heads: int, *, vocab: int = 51200, sequence: int = 2048,
        dropout: bool = True) -> Transformer:
    """A GPT as Megatron-LM trains it (GPT-2's architecture at any size): the published runs
    are described so."""
    return Transformer(family="gpt2", layers=layers, hidden=hidden, heads=heads,
                       kv_heads=heads, head_dim=hidden // heads, ffn=4 * hidden, vocab=vocab,
                       gated=False, norm="layernorm", biases=True, tied=True,
                       positions=sequence, dropout=dropout)


def parameters_text(model: Transformer) -> str:
    """'175.0B parameters' (active ones too for MoE)."""
    def short(n: float) -> str:
        for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
            if n >= size:
                return f"{n / size:.1f}{unit}"
        return f"{n:.0f}"
    text = f"{short(model.params)} parameters"
    if model.experts:
        text += f" ({short(model.active_params)} active)"
    return text
