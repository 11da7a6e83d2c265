"""Small runnable models for the example plans (plans/gpt-mshape.yaml, plans/flava-kshape.yaml,
plans/transformer-vshape.yaml), written to pyplan's `model:` contract. They need torch."""

__all__: list[str] = []
