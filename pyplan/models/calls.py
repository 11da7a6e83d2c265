"""How pyplan calls a user's model on a micro-batch's inputs, the same everywhere (partition,
profile, `pyplan run`, --check's reference): a dict is passed as keyword arguments
(`model(**inputs)`: input_ids, attention_mask, decoder_input_ids, pixel_values, ...), a tuple
as positional arguments (`model(*inputs)`: a U-Net's sample and timestep), anything else (a
tensor) as the one argument, as torch.distributed.pipelining's `mb_args`/`mb_kwargs` and
`model(*args, **kwargs)` take them. And what the loss gets of the model's output."""

from __future__ import annotations

import inspect

from torch import nn

__all__ = ["arguments", "call", "call_model", "for_loss", "model_keywords"]


def arguments(inputs) -> tuple[tuple, dict]:
    """A micro-batch's inputs as (positional arguments, keyword arguments)."""
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, tuple):
        return inputs, {}
    return (inputs,), {}


def call(module: nn.Module, inputs, **extra):
    """`module` called on a micro-batch's inputs (see the module docstring)."""
    args, kwargs = arguments(inputs)
    return module(*args, **kwargs, **extra)


def model_keywords(model: nn.Module, inputs=None) -> dict:
    """Keywords pyplan adds to a call of the whole model: `use_cache=False` where its forward
    takes it (a generation model would otherwise build caches it does not need, and return
    them), unless the inputs say otherwise."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    given = inputs if isinstance(inputs, dict) else {}
    return {"use_cache": False} if "use_cache" in parameters and "use_cache" not in given \
        else {}


def call_model(model: nn.Module, inputs):
    """The whole model's own forward on a micro-batch's inputs."""
    return call(model, inputs, **model_keywords(model, inputs))


def for_loss(output):
    """What the loss gets of the last stage's output: the `.logits` of an output that has
    them (a Hugging Face ModelOutput of a language model or classifier: the documented
    contract of a causal LM's loss), else the output as the model returns it (a CLIPOutput,
    a U-Net's output, a tensor)."""
    found = getattr(output, "logits", None)
    return output if found is None else found
