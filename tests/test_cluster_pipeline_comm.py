"""`pyplan plan`'s pipeline traffic by piece, against hand counts: what a stage boundary sends
with Megatron-LM's scatter/gather and without it (DeepSpeed's pipeline engine), the receiver's
all-gather, a tied embedding's gradient all-reduce between the first and the last stage, and
the frameworks' layer splits."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pyplan.cluster import collectives, constants
from pyplan.cluster.costs import Costs
from pyplan.cluster.framework import FRAMEWORKS, framework
from pyplan.cluster.hardware import load_cluster
from pyplan.cluster.layout import Batch, Layout
from pyplan.cluster.model import gpt
from pyplan.cluster.pipeline import (boundary_traffic, chunks, gradient_sync, split_layers,
                                     tied_embedding_sync)
from pyplan.cli import main

A100 = replace(load_cluster("dgx-a100-80gb"), nodes=4)
GPT = gpt(8, 2048, 16, vocab=51200, sequence=2048)
TOKENS = 2 * 2048  # a micro-batch of 2 sequences


def _costs(layout: Layout, name: str = "megatron", dtype: str = "fp16") -> Costs:
    return Costs(GPT, A100, layout, Batch(64, 2048, dtype, False, framework(name)))


def test_a_scattered_send_carries_a_tensor_ranks_share_and_the_receiver_gathers_it():
    """tp 4 without sequence parallelism: each rank sends 2 x 2048 x 2048 x 2 / 4 bytes; the
    receiver's all-gather moves the whole activation over its 4 NVLink ranks (3/4 of 16 MiB
    at the link's bus bandwidth with NCCL's Simple protocol: its fixed 8.4 us and 3 ring steps
    of 3.4 us)."""
    layout = Layout(4, 2, 4, micro_batch=2, recompute="full")
    whole = TOKENS * 2048 * 2
    sent, gather = boundary_traffic(_costs(layout))
    assert sent == whole / 4
    link = A100.link_gbs * 1e9 * A100.link_efficiency
    assert gather == pytest.approx((8.4 + 3 * 3.4) * 1e-6 + 3 / 4 * whole / link)
    # DeepSpeed's pipeline engine: every tensor rank sends the whole, nothing to gather
    assert boundary_traffic(_costs(layout, "megatron-deepspeed")) == (whole, 0.0)
    # sequence parallelism: each rank's shard of the sequence, as it is
    assert boundary_traffic(_costs(replace(layout, sequence_parallel=True))) == \
        (whole / 4, 0.0)
    assert boundary_traffic(_costs(replace(layout, tp=1, dp=16))) == (whole, 0.0)


def test_blocking_sends_and_the_gathers_sit_on_each_stages_passes():
    """pp 2 across nodes (tp 4 x dp 4 fill a node): stage 0's forward ends with its send over
    the network and its backward begins with the gradient's gather; stage 1's forward begins
    with the activation's gather and its backward ends with the gradient's send."""
    layout = Layout(4, 2, 4, micro_batch=2, recompute="full")
    costs = _costs(layout)
    sent, gather = boundary_traffic(costs)
    send = collectives.send(A100, sent, True)
    assert send == pytest.approx((constants.COLLECTIVE_US + A100.network_latency_us) * 1e-6 +
                                 sent / (A100.network_gbs * 1e9 * A100.network_efficiency))
    first, last = chunks(GPT, A100, layout, costs.batch, (4, 4))
    assert first.forward.parts["pp_comm"] == pytest.approx(send)
    assert first.backward.parts["pp_comm"] == pytest.approx(gather)
    assert last.forward.parts["pp_comm"] == pytest.approx(gather)
    assert last.backward.parts["pp_comm"] == pytest.approx(send)
    deepspeed = chunks(GPT, A100, layout, _costs(layout, "megatron-deepspeed").batch, (4, 4))
    whole = collectives.send(A100, TOKENS * 2048 * 2, True)
    assert deepspeed[0].forward.parts["pp_comm"] == pytest.approx(whole)
    assert deepspeed[1].forward.parts["pp_comm"] == 0.0


def test_where_a_node_holds_two_stages_every_other_boundary_crosses_the_network():
    """tp 2 x dp 2: four GPUs a stage, two stages a node. Stage 0 sends to stage 1 over
    NVLink, stage 1 to stage 2 over the network, and the gradients come back the same way."""
    layout = Layout(2, 4, 2, micro_batch=2, recompute="full")
    costs = _costs(layout)
    sent, gather = boundary_traffic(costs)
    link, network = collectives.send(A100, sent, False), collectives.send(A100, sent, True)
    assert link < network
    stages = chunks(GPT, A100, layout, costs.batch, (2, 2, 2, 2))
    assert [s.forward.parts["pp_comm"] - (gather if i else 0.0)
            for i, s in enumerate(stages)] == pytest.approx([link, network, link, 0.0])
    assert [s.backward.parts["pp_comm"] - (gather if i < 3 else 0.0)
            for i, s in enumerate(stages)] == pytest.approx([0.0, link, network, link])
    assert layout.pipeline_across_nodes(8) and not Layout(2, 2, 2).pipeline_across_nodes(8)


def test_a_tied_embedding_is_all_reduced_between_the_first_and_the_last_stage():
    """51,200 x 2,048 / 4 fp16 gradients (52.4 MB) between two GPUs on two nodes: a ring of 2
    moves half of them each way over the network, with NCCL's Simple protocol two network
    steps of 9.6 us after its fixed 8.4 us, 1.9 times that for a large ring all-reduce across
    nodes (NCCL's plateau); the first and the last stage wait for it, a middle one does not."""
    layout = Layout(4, 4, 2, micro_batch=2, recompute="full")
    costs = _costs(layout)
    nbytes = 51200 * 2048 / 4 * 2
    network = A100.network_gbs * 1e9 * A100.network_efficiency
    expected = (8.4 + 2 * 9.6) * 1.9 * 1e-6 + nbytes / network
    assert tied_embedding_sync(costs) == pytest.approx(expected)
    stages = chunks(GPT, A100, layout, costs.batch, (2, 2, 2, 2))
    assert [s.sync - gradient_sync(costs, s.parameters, 0.0, s.forward, s.backward + s.weight)
            for s in stages] == pytest.approx([expected, 0.0, 0.0, expected])
    plain = Costs(replace(GPT, tied=False), A100, layout, costs.batch)
    assert tied_embedding_sync(plain) == 0.0
    assert tied_embedding_sync(_costs(replace(layout, pp=1, dp=8))) == 0.0
    # bf16: fp32 main gradients, twice the bytes
    assert tied_embedding_sync(_costs(layout, dtype="bf16")) == pytest.approx(
        expected + nbytes / network)


def test_megatron_splits_the_layers_evenly_where_others_balance_the_head():
    """A small GPT with a large vocabulary: its head outweighs a layer, so the balanced split
    gives the last stage fewer layers; Megatron-LM (and DeepSpeed's type:transformer) split
    8 layers over 4 stages 2 each, and where the stages do not divide them, balance."""
    model = gpt(8, 512, 8, vocab=256000, sequence=2048)
    layout = Layout(1, 4, 1, micro_batch=1)
    for name, expected in (("megatron", (2, 2, 2, 2)), ("megatron-deepspeed", (2, 2, 2, 2))):
        costs = Costs(model, A100, layout, Batch(8, 2048, "bf16", True, framework(name)))
        assert split_layers(model, 4, costs) == expected
    balanced = split_layers(model, 4, Costs(model, A100, layout,
                                            Batch(8, 2048, "bf16", True, framework("nemo"))))
    assert sum(balanced) == 8 and balanced[-1] < 2
    odd = Costs(model, A100, replace(layout, pp=3), Batch(8, 2048, "bf16", True))
    assert sum(split_layers(model, 3, odd)) == 8
    assert [n for n, f in FRAMEWORKS.items() if f.even_split] == ["megatron",
                                                                   "megatron-deepspeed"]


def test_the_megatron_deepspeed_framework_is_a_choice_and_named(tmp_path, capsys):
    import json
    config = {"model_type": "gpt2", "n_embd": 1024, "n_layer": 8, "n_head": 16,
              "vocab_size": 50257, "n_positions": 2048}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    argv = ["plan", str(path), "--cluster", "dgx-a100-80gb", "--gpus", "16",
            "--global-batch", "64", "--seq", "2048", "--framework", "megatron-deepspeed",
            "--tp", "2", "--pp", "2", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["framework"]["name"] == "megatron-deepspeed"
    assert out["framework"]["p2p_scatter_gather"] is False
    assert out["layers_per_stage"] == [4, 4]


def test_nccl_gathers_and_scatters_in_rings_only_where_an_all_reduce_may_use_its_tree():
    """64 nodes of 8, one byte, NCCL's LL protocol (its quickest steps): an all-gather pays its
    ring's 448 NVLink steps (0.47 us, 1.8 times that in a collective across nodes) and 63
    network steps (2.7 us) after LL's fixed 3.6 us (NCCL has no tree for all-gather or
    reduce-scatter); an all-reduce takes its tree instead: 7 NVLink steps (0.52 us x 1.8) and
    log2 64 = 6 network steps (5 us) each way after the tree's fixed 4.4 us."""
    gather = collectives.all_gather(A100, 1.0, 512, 8)
    assert gather == pytest.approx((3.6 + 448 * 0.47 * 1.8 + 63 * 2.7) * 1e-6, rel=1e-3)
    assert collectives.reduce_scatter(A100, 1.0, 512, 8) == gather
    reduce = collectives.all_reduce(A100, 1.0, 512, 8)
    assert reduce == pytest.approx((4.4 + 2 * (7 * 0.52 * 1.8 + 6 * 5.0)) * 1e-6, rel=1e-3)


@pytest.mark.parametrize("nbytes, protocol", [(64 * 1024, "LL"), (4 * 2**20, "LL128"),
                                              (256 * 2**20, "Simple")])
def test_an_all_reduce_inside_a_node_takes_the_fastest_nccl_protocol_at_its_size(
        nbytes, protocol):
    """8 GPUs of a DGX A100, 14 ring steps: LL's quick steps (0.47 us) at a quarter of the bus
    bandwidth win small messages, LL128's (1.9 us) at 92% of it the middle ones, Simple's
    (3.4 us) at all of it the large ones (NCCL's tuning model's figures)."""
    bus = A100.link_gbs * 1e9 * A100.link_efficiency
    moved = 2 * 7 / 8 * nbytes
    times = {"LL": (3.6 + 14 * 0.47) * 1e-6 + moved / (bus / 4),
             "LL128": (10.0 + 14 * 1.9) * 1e-6 + moved / (bus * 0.92),
             "Simple": (8.4 + 14 * 3.4) * 1e-6 + moved / bus}
    assert min(times, key=times.get) == protocol
    assert collectives.all_reduce(A100, nbytes, 8, 8) == pytest.approx(times[protocol])


def test_megatron_core_overlaps_pipeline_sends_under_the_interleaved_schedule_only():
    """Megatron-LM and NeMo: 1F1B's sends sit on the passes (Megatron-Core pairs them with the
    receives in blocking batches); with a virtual pipeline they go beside compute (its
    --overlap-p2p-communication, on by default), unless turned off."""
    one = Layout(1, 2, 4, micro_batch=2, recompute="full")
    two = replace(one, vpp=2, schedule="interleaved-1f1b")
    for name in ("megatron", "nemo"):
        batch = _costs(one, name).batch
        blocking = chunks(GPT, A100, one, batch, (4, 4))
        assert blocking[0].send == 0.0 and blocking[0].forward.parts["pp_comm"] > 0
        overlapped = chunks(GPT, A100, two, batch, (2, 2, 2, 2))
        assert overlapped[0].send > 0 and overlapped[0].forward.parts["pp_comm"] == 0.0
    off = Batch(64, 2048, "fp16", False, framework("megatron", overlap_p2p=False))
    assert chunks(GPT, A100, two, off, (2, 2, 2, 2))[0].send == 0.0


def test_an_interleaved_pipeline_of_uneven_layers_is_split_by_gpu_where_that_runs_faster():
    """22 layers over 8 GPUs of 2 chunks (the zero bubble paper's 1.5B GPT): balancing each
    chunk's time leaves GPUs 1-5 three layers in a 2 + 1 split and the last GPU two beside the
    head; balancing the GPUs gives each its share (the head's GPU and the embedding's fewer),
    its extra layer on its second chunk, of which interleaved 1F1B holds fewer micro-batches in
    flight. predict() prices both and keeps the faster that fits."""
    from pyplan.cluster.pipeline import device_split, splits
    from pyplan.cluster.predict import predict

    model = gpt(22, 2304, 24, vocab=51200, sequence=1024)
    layout = Layout(1, 8, 1, 2, 6, "none", False, "interleaved-1f1b", False)
    batch = Batch(144, 1024, "fp16", False)
    costs = Costs(model, A100, layout, batch)
    by_gpu = device_split(model, layout, costs)
    shares = [by_gpu[d] + by_gpu[d + 8] for d in range(8)]
    assert sum(shares) == 22 and max(shares) == 3 and min(shares) == 2
    assert all(by_gpu[d] <= by_gpu[d + 8] for d in range(8))  # the extra on the later chunk
    both = splits(model, layout, costs)
    assert both[1] == by_gpu and len(both) == 2
    priced = {split: predict(model, A100, layout, batch, split) for split in both}
    chosen = predict(model, A100, layout, batch)
    assert chosen.seconds == min(p.seconds for p in priced.values() if p.fits)
    assert chosen.layers_per_stage == by_gpu  # here the faster, and it holds less
    assert priced[by_gpu].memory_bytes < priced[both[0]].memory_bytes
    # an even split where the framework splits evenly and the stages divide the layers
    even = replace(layout, pp=2, vpp=2)
    assert splits(replace(model, layers=24), even, Costs(replace(model, layers=24), A100,
                                                         even, batch)) == [(6, 6, 6, 6)]
