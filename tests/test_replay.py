"""A model built on the meta device gets, parameter by parameter, the values its factory gave
it: each replayed parameter is compared with the same factory built eagerly. Random values
differ in their bits (a replay draws from the run's seed, per parameter), so the oracle is the
distribution: a constant must be equal, everything else finite, in the eager value's range,
with its mean and spread. That catches a recipe replayed in the wrong order (an
initialisation written as `p.copy_(f(p))` once replayed as NaN or values near 1e38)."""

from __future__ import annotations

import math
import warnings

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from models import hf  # noqa: E402
from pyplan.models.deferred import defer  # noqa: E402


def assert_replayed_like_eager(factory, draws: int = 4) -> None:
    """Every replayed parameter is like the eager factory's: its draws under `draws` seeds
    pooled, so a parameter of two values (a head's attention sink) has a range to fall in."""
    eager = []
    for seed in range(draws):
        torch.manual_seed(seed)
        eager.append(dict(factory().named_parameters()))
    deferred = defer(factory, seed=0)
    assert not deferred.eager, deferred.why_eager
    values = deferred.values(list(eager[0]))
    for name, want in eager[0].items():
        got = values[name]
        assert got.shape == want.shape and got.dtype == want.dtype, name
        pooled = torch.cat([e[name].detach().flatten() for e in eager])
        assert torch.isfinite(got).all() or not torch.isfinite(pooled).all(), name
        _similar(name, got.double(), pooled.double())


def _similar(name: str, got, want) -> None:
    low, high = float(want.min()), float(want.max())
    if low == high:  # ones, zeros, a constant fill: no randomness, the same bits
        assert torch.equal(got.flatten(), want[:got.numel()]), \
            f"{name}: {got.flatten()[:4]} for {low}"
        return
    span = (high - low) * (1 if want.numel() >= 64 else 3)  # a few draws: a wider range
    assert float(got.min()) >= low - span and float(got.max()) <= high + span, \
        f"{name}: values in [{float(got.min()):.3g}, {float(got.max()):.3g}], eager " \
        f"[{low:.3g}, {high:.3g}]"
    if got.numel() >= 64:
        std = float(want.std())
        assert abs(float(got.mean() - want.mean())) <= 0.2 * std + 4 * std / got.numel() ** .5, \
            f"{name}: mean {float(got.mean()):.3g}, eager {float(want.mean()):.3g}"
        assert 0.6 < float(got.std()) / std < 1.6, \
            f"{name}: spread {float(got.std()):.3g}, eager {std:.3g}"


class _Derived(nn.Module):
    """Initialisations that read the parameter they write, as `_init_weights` writes them."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.a_log = nn.Parameter(torch.empty(64))
        self.dt_bias = nn.Parameter(torch.empty(64))
        self.drawn = nn.Parameter(torch.randn(64))
        self.rows = nn.Parameter(torch.ones(8, 8))
        self.halved = nn.Parameter(torch.empty(8, 8))
        with torch.no_grad():
            self.linear.weight.copy_(self.linear.weight / 2)            # w.copy_(w / 2)
            self.a_log.copy_(torch.empty_like(self.a_log).uniform_(1, 16).log_())
            dt = torch.exp(torch.rand(64) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))       # Mamba's dt_bias
            self.drawn.copy_(self.drawn * 2)       # its creation's value, read after
            self.rows[0].zero_()                   # a part of it
            self.rows.data.mul_(3)                 # through .data
            self.halved.normal_()
            self.halved.div_(2)


def test_initialisations_that_read_what_they_write_replay_right():
    assert_replayed_like_eager(_Derived)
    values = defer(_Derived, seed=0).values(["a_log", "rows", "halved"])
    assert 0 <= float(values["a_log"].min()) and float(values["a_log"].max()) <= math.log(16)
    assert torch.equal(values["rows"][0], torch.zeros(8))
    assert torch.equal(values["rows"][1:], torch.full((7, 8), 3.0))
    assert 0.3 < float(values["halved"].std()) < 0.7


def test_a_write_that_nothing_reads_before_an_overwrite_is_skipped():
    # Linear's reset_parameters then a normal_ over it: the first draws are lost either way.
    def factory():
        layer = nn.Linear(32, 32)
        with torch.no_grad():
            layer.weight.normal_(0, 0.02)
        return layer
    assert_replayed_like_eager(factory)
    deferred = defer(factory, seed=0)
    assert len(deferred._dead) >= 1


@pytest.mark.parametrize("family", hf.FAMILIES + hf.HYBRIDS)
def test_every_family_replays_its_initialisation(family):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_replayed_like_eager(lambda: hf.build(family))
