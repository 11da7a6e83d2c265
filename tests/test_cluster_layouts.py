"""`pyplan plan`'s cost model by piece, against hand counts: a GEMM's wave quantisation, an FSDP
layer's all-gathers and reduce-scatter, a context-parallel ring's exchanges, an expert layer's
all-to-alls, the frameworks' overlaps, fp8's GEMMs, FSDP's memory; and the new flags on the
command line (tensor parallelism across nodes warned, not refused; the same bytes twice)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from pyplan.cluster import collectives, kernels
from pyplan.cluster.costs import Costs
from pyplan.cluster.framework import framework
from pyplan.cluster.hardware import load_cluster
from pyplan.cluster.layout import Batch, Layout, check_layout
from pyplan.cluster.memory import stage_state, state_bytes_per_parameter
from pyplan.cluster.model import Transformer
from pyplan.cli import main

A100 = load_cluster("dgx-a100-80gb")
H100 = load_cluster("dgx-h100")
LLAMA = Transformer(family="llama", layers=4, hidden=1024, heads=16, kv_heads=4, head_dim=64,
                    ffn=2816, vocab=32000, gated=True, norm="rmsnorm", biases=False)
MOE = replace(LLAMA, family="mixtral", experts=8, top_k=2, expert_ffn=1024, moe_layers=4)


def _recording(monkeypatch, name):
    calls = []
    original = getattr(collectives, name)

    def record(cluster, nbytes, *args, **kwargs):
        calls.append(nbytes)
        return original(cluster, nbytes, *args, **kwargs)
    monkeypatch.setattr(collectives, name, record)
    return calls


def test_a_gemm_one_tile_past_a_full_wave_pays_for_the_tiles_it_leaves_empty():
    """3,072 x 1,152 is 108 tiles of 256 x 128: one full wave of an A100's 108 SMs. At 3,072 x
    1,280 the best tile is 128 x 64 (480 tiles in 5 waves of 108: 480/540 of the slots used,
    at 0.80 of the large tile's rate); 256 x 128 would leave 96 of 216 slots empty."""
    gpu, peak, k = A100.gpu, 312e12, 8192
    full = kernels.gemm(gpu, peak, 2, 3072, 1152, k) - kernels.launches(gpu, 1)
    over = kernels.gemm(gpu, peak, 2, 3072, 1280, k) - kernels.launches(gpu, 1)
    rate = peak * gpu.matmul_efficiency * k / (k + kernels.constants.K_OVERHEAD)
    assert full == pytest.approx(2 * 3072 * 1152 * k / rate)
    assert over == pytest.approx(2 * 3072 * 1280 * k / (rate * 0.80 * 480 / 540))


def test_a_short_k_loop_and_a_thin_gemm_run_below_peak_and_never_beat_hbm():
    gpu = A100.gpu
    long_k = kernels.gemm(gpu, 312e12, 2, 8192, 8192, 8192)
    short_k = kernels.gemm(gpu, 312e12, 2, 8192, 8192, 128) * 64
    assert short_k > 1.5 * long_k  # 128 / (128 + K_OVERHEAD) of the rate, and the roofline
    thin = kernels.gemm(gpu, 312e12, 2, 8192, 8, 8192)
    hbm = 2 * (8192 * 8192 + 8192 * 8) / (gpu.memory_bandwidth_gbs * 1e9 * 0.9)
    assert thin >= hbm


def test_an_fsdp_layer_gathers_its_parameters_twice_and_reduce_scatters_its_gradients(
        monkeypatch):
    gathers, reduces = _recording(monkeypatch, "all_gather"), []
    monkeypatch.setattr(collectives, "reduce_scatter",
                        lambda cluster, nbytes, *a, **k: reduces.append(nbytes) or 0.0)
    layout = Layout(1, 1, 16, 1, 1, "none", False, "1f1b", False, fsdp=True)
    batch = Batch(16, 2048, "bf16", True, framework("megatron"))  # no prefetch: all exposed
    layer = Costs(LLAMA, A100, layout, batch).layer(False)
    params = LLAMA.layer_params(False)
    assert gathers == [params * 2] and reduces == [params * 4]  # bf16 weights, fp32 grads
    gather = collectives.all_gather(A100, params * 2, 16, 8)
    scatter = collectives.reduce_scatter(A100, params * 4, 16, 8)
    assert layer.forward.parts["fsdp_comm"] == pytest.approx(gather)
    assert layer.backward.parts["fsdp_comm"] == pytest.approx(gather + scatter)
    # prefetched: only what outlasts the compute beside it
    overlapped = Costs(LLAMA, A100, layout, replace(batch, framework=framework("torchtitan")))
    hidden = overlapped.layer(False)
    assert hidden.forward.parts["fsdp_comm"] == pytest.approx(max(
        0.0, collectives.all_gather(A100, params * 2, 16, 8, True) - hidden.forward.compute))


def test_fp8_gathers_its_weights_in_one_byte_and_runs_its_linear_gemms_at_the_fp8_peak(
        monkeypatch):
    gathers = _recording(monkeypatch, "all_gather")
    layout = Layout(1, 1, 16, 1, 1, "none", False, "1f1b", False, fsdp=True)
    fp8 = Costs(LLAMA, H100, layout, Batch(16, 2048, "fp8", True, framework("torchtitan")))
    fp8.layer(False)
    assert gathers[0] == LLAMA.layer_params(False) * 1
    bf16 = Costs(LLAMA, H100, layout, Batch(16, 2048, "bf16", True, framework("torchtitan")))
    launch = kernels.launches(H100.gpu, 1)
    ratio = 989 / (1979 * kernels.constants.FP8_EFFICIENCY)

    def k_use(peak):  # the K loop's fixed prologue is more elements at the faster fp8 rate
        c = kernels.constants
        return 8192 / (8192 + c.K_OVERHEAD * peak / H100.gpu.sms / c.REFERENCE_SM_FLOPS)
    assert fp8.gemm(8192, 8192, 8192, fp8=True) - launch == pytest.approx(
        ratio * k_use(989e12) / k_use(1979e12 * kernels.constants.FP8_EFFICIENCY) *
        (bf16.gemm(8192, 8192, 8192) - launch))
    assert fp8.linear(8192, 8192, 8192) > fp8.gemm(8192, 8192, 8192, fp8=True)  # the cast


def test_a_context_parallel_ring_passes_keys_and_values_cp_minus_1_times_each_way(monkeypatch):
    sends = []
    monkeypatch.setattr(collectives, "send", lambda cluster, nbytes, across:
                        sends.append((nbytes, across)) or 1.0)  # 1 s: outlasts every block
    cp, s, b = 4, 8192, 1
    layout = Layout(1, 1, 2, 1, b, "none", False, "1f1b", False, cp=cp)
    costs = Costs(LLAMA, A100, layout, Batch(2, s, "bf16"))
    layer = costs.layer(False)
    kv = 2 * b * s / cp * LLAMA.kv_dim * 2  # this rank's keys and values, bf16
    assert sends == [(kv, False)]
    core_f, core_b = costs.attention_core(b, LLAMA.heads)
    assert layer.forward.parts["cp_comm"] == pytest.approx((cp - 1) * (1.0 - core_f / cp))
    assert layer.backward.parts["cp_comm"] == pytest.approx((cp - 1) * (2.0 - core_b / cp))
    # each rank computes 1/cp of the causal triangle: the diagonal block causal, the other
    # cp - 1 half each (chunks i and 2cp-1-i)
    blocks = []
    monkeypatch.setattr(kernels, "attention", lambda gpu, peak, sequences, heads, queries,
                        keys, d, causal=True, bias=False: blocks.append(
                            queries * keys * (0.5 if causal else 1.0)) or (1.0, 2.0))
    assert costs.attention_core(b, LLAMA.heads) == (1 + (cp - 1) / 2, 2 + (cp - 1))
    assert blocks[0] + (cp - 1) * blocks[1] / 2 == pytest.approx(s * s / 2 / cp)


def test_an_expert_layer_dispatches_and_combines_its_routed_tokens_each_way(monkeypatch):
    sizes = _recording(monkeypatch, "all_to_all")
    ep, b, s = 4, 2, 1024
    layout = Layout(1, 1, 8, 1, b, "none", False, "1f1b", False, ep=ep)
    costs = Costs(MOE, A100, layout, Batch(16, s, "bf16"))
    layer = costs.layer(True)
    tokens = b * s * MOE.top_k
    assert sizes == [tokens * MOE.hidden * 2]
    one = collectives.all_to_all(A100, tokens * MOE.hidden * 2, ep, 4)
    assert layer.forward.parts["ep_comm"] == pytest.approx(2 * one)
    assert layer.backward.parts["ep_comm"] == pytest.approx(2 * one)
    # an all-to-all across nodes sends what leaves the node over one port per GPU
    across = collectives.all_to_all(A100, 1e9, 16, 8) - collectives.all_to_all(A100, 0, 16, 8)
    assert across > 0.5e9 / (A100.network_gbs * 1e9)


def test_tensor_parallel_collectives_across_nodes_run_at_network_bandwidth():
    inside = collectives.all_reduce(A100, 2e9, 8, 8) - collectives.all_reduce(A100, 1e9, 8, 8)
    across = collectives.all_reduce(A100, 2e9, 16, 8) - collectives.all_reduce(A100, 1e9, 16, 8)
    assert inside == pytest.approx(2 * 7 / 8 * 1e9 / (A100.link_gbs * 1e9 *
                                                      A100.link_efficiency))
    # the node's eight ports carry the ring between the two nodes
    assert across == pytest.approx(2 * 15 / 16 * 1e9 / (8 * A100.network_gbs * 1e9 *
                                                        A100.network_efficiency))
    layout = Layout(16, 1, 1, 1, 1)
    model = replace(LLAMA, heads=16, kv_heads=16)
    assert check_layout(layout, model, Batch(1, 2048), 16, 8) is None
    assert check_layout(Layout(12, 1, 1, 1, 1), replace(LLAMA, heads=24, kv_heads=24),
                        Batch(1, 2048), 12, 8) is not None  # not whole nodes


def test_each_frameworks_overlaps_hide_what_megatrons_defaults_expose():
    wide = replace(LLAMA, hidden=8192, heads=64, kv_heads=8, head_dim=128, ffn=28672)
    layout = Layout(4, 1, 4, 1, 2, "none", True, "1f1b", True)
    batch = Batch(64, 4096, "bf16")
    megatron = Costs(wide, A100, layout, batch).layer(False)
    nemo = Costs(wide, A100, layout, replace(batch, framework=framework("nemo"))).layer(False)
    # hidden behind the GEMMs but for the first of tp chunks, at the overlapped bandwidth,
    # and the SMs NCCL holds meanwhile
    costs = Costs(wide, A100, layout, replace(batch, framework=framework("nemo")))
    overlapped = 2 * costs.tp_collective(2 * 4096 * wide.hidden * 2, overlapped=True)
    assert nemo.forward.parts["tp_comm"] == pytest.approx(
        overlapped / 4 + costs.contention(overlapped * 3 / 4))
    assert nemo.forward.parts["tp_comm"] < megatron.forward.parts["tp_comm"]
    off = framework("nemo", tp_comm_overlap=False)
    assert Costs(wide, A100, layout, replace(batch, framework=off)).layer(False).forward \
        .parts["tp_comm"] == pytest.approx(megatron.forward.parts["tp_comm"])
    # GEMMs too short to hide the overlapped chunks: no slower than blocking
    small = Costs(LLAMA, A100, layout, replace(batch, framework=framework("nemo"))).layer(False)
    blocking = Costs(LLAMA, A100, layout, batch).layer(False)
    assert small.forward.parts["tp_comm"] <= blocking.forward.parts["tp_comm"]


def test_fsdp_shards_every_state_and_holds_two_gathered_layers():
    layout = Layout(1, 1, 16, 1, 1, "none", False, "1f1b", False, fsdp=True)
    params, largest = 1e9, 1e8
    state = stage_state(params, Batch(16, 2048), layout, largest_layer=largest)
    per = state_bytes_per_parameter("bf16")
    assert state.total == pytest.approx(params * sum(per.values()) / 16 +
                                        largest * (2 * 2 + 4))
    hsdp = replace(layout, dp_replicate=4)
    assert stage_state(params, Batch(16, 2048), hsdp, largest_layer=largest).total > \
        state.total  # shards over 4 ranks, not 16


def _config(tmp_path, **changes):
    config = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2816,
              "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 16,
              "vocab_size": 32000, **changes}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_new_flags_price_the_layout_they_fix_and_name_every_dimension(tmp_path, capsys):
    argv = ["plan", _config(tmp_path), "--cluster", "dgx-h100", "--gpus", "32",
            "--global-batch", "32", "--seq", "16384", "--framework", "torchtitan", "--tp", "2",
            "--cp", "2", "--fsdp", "--dp-replicate", "2", "--dtype", "fp8", "--json"]
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert main(argv) == 0
    second = capsys.readouterr().out
    one, two = json.loads(first), json.loads(second)
    one["search"].pop("seconds"), two["search"].pop("seconds")
    assert one == two
    layout = one["layout"]
    assert (layout["tp"], layout["cp"], layout["fsdp"], layout["dp_replicate"]) == \
        (2, 2, True, 2)
    assert layout["tp"] * layout["cp"] * layout["pp"] * layout["dp"] == 32
    assert one["framework"]["name"] == "torchtitan" and one["batch"]["dtype"] == "fp8"
    assert one["breakdown"]["cp_communication"] >= 0 and math.isfinite(one["mfu"])


def test_tensor_parallelism_wider_than_a_node_is_predicted_with_a_warning(tmp_path, capsys):
    argv = ["plan", _config(tmp_path), "--cluster", "dgx-a100-80gb", "--gpus", "16",
            "--global-batch", "16", "--seq", "2048", "--tp", "16", "--pp", "1"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "warning: --tp 16 spans 2 nodes" in captured.err
    assert "tp 16 x pp 1 x dp 1" in captured.out


def test_a_context_parallel_layout_is_exported_with_the_frameworks_overlaps(tmp_path, capsys):
    argv = ["plan", _config(tmp_path), "--cluster", "dgx-h100", "--gpus", "8",
            "--global-batch", "8", "--seq", "8192", "--tp", "1", "--cp", "2", "--pp", "1",
            "--framework", "nemo", "--megatron", str(tmp_path / "args.txt")]
    assert main(argv) == 0
    line = (tmp_path / "args.txt").read_text().splitlines()[-1].split()
    assert line[line.index("--context-parallel-size") + 1] == "2"
    assert "--overlap-grad-reduce" in line and "--overlap-param-gather" in line
    argv[argv.index("nemo")] = "megatron"
    assert main(argv) == 0
    assert "--overlap-grad-reduce" not in (tmp_path / "args.txt").read_text()


def test_a_k_loops_fixed_prologue_is_more_elements_on_faster_sms():
    gpu, k = H100.gpu, 1024
    c = kernels.constants
    full = kernels.gemm(gpu, 989e12, 2, 8448, 4096, k) - kernels.launches(gpu, 1)
    # 8448 x 4096 in 256 x 128 tiles: 33 x 32 = 1,056 tiles, 8 full waves of 132 SMs
    overhead = c.K_OVERHEAD * (989e12 / 132) / (312e12 / 108)  # ~2.6x an A100's elements
    assert full == pytest.approx(2 * 8448 * 4096 * k / (
        989e12 * gpu.matmul_efficiency * k / (k + overhead)))
    a100 = kernels.gemm(A100.gpu, 312e12, 2, 8448, 4096, k) - kernels.launches(A100.gpu, 1)
    assert a100 / full < 989e12 * gpu.matmul_efficiency / (312e12 * A100.gpu.matmul_efficiency)


def test_eager_pytorch_moves_the_bytes_of_its_decomposed_norms_rotary_and_gate():
    layout = Layout(1, 1, 8, 1, 2, "none", False, "1f1b", False)
    batch = Batch(16, 2048, "bf16", True, framework("torchtitan", fused_kernels=False))
    eager = Costs(LLAMA, H100, layout, batch).elementwise_forward(False)
    fused = Costs(LLAMA, H100, layout, replace(batch, framework=framework("megatron")))
    T = 2 * 2048
    # RMSNorm: up to fp32 (2 + 4), square (4 + 4), mean (4), scale (4 + 4), back (4 + 2),
    # weight (2 + 2) = 36 bytes an element where a fused kernel moves 4; rotary 20 against 4;
    # SiLU and the gate's product 10 against a fused gate's 6
    extra = 2 * (36 - 4) * T * 1024 + (20 - 4) * (1024 + 256) * T + (10 - 6) * 2816 * T
    assert eager - fused.elementwise_forward(False) == pytest.approx(extra)
    compiled = Costs(LLAMA, H100, layout, replace(batch, framework=framework("torchtitan")))
    assert compiled.elementwise_forward(False) == fused.elementwise_forward(False)


def test_alibi_has_no_rotary_and_its_fused_attention_pays_for_the_bias():
    mpt = replace(LLAMA, family="mpt", alibi=True)
    layout = Layout(1, 1, 8, 1, 2, "none", False, "1f1b", False)
    batch = Batch(16, 2048, "bf16", True, framework("megatron"))
    rope, bias = Costs(LLAMA, A100, layout, batch), Costs(mpt, A100, layout, batch)
    T = 2 * 2048
    assert rope.elementwise_forward(False) - bias.elementwise_forward(False) == \
        pytest.approx(2 * 2 * (1024 + 256) * T)
    launch = kernels.launches(A100.gpu, 1)
    plain, biased = rope.attention_core(2, 16)[0], bias.attention_core(2, 16)[0]
    assert biased - launch == pytest.approx((plain - launch) / kernels.constants.BIAS_ATTENTION)


def test_deepspeeds_bf16_pipeline_adds_each_micro_batchs_gradients_in_a_pass_of_their_own():
    from pyplan.cluster.pipeline import chunks

    layout = Layout(1, 2, 1, 1, 1, "full", False, "1f1b", False)
    deepspeed = framework("megatron-deepspeed")
    fused = framework("megatron-deepspeed", grad_accumulation_pass=False)
    for dtype, passes in (("bf16", 1), ("fp16", 0)):
        with_pass = chunks(LLAMA, A100, layout, Batch(8, 2048, dtype, False, deepspeed), (2, 2))
        without = chunks(LLAMA, A100, layout, Batch(8, 2048, dtype, False, fused), (2, 2))
        for a, b in zip(with_pass, without):
            extra = a.backward.parts["elementwise"] - b.backward.parts["elementwise"]
            assert extra == pytest.approx(passes * a.parameters * 20 / (
                A100.gpu.memory_bandwidth_gbs * 1e9 * 0.9))


def test_fp8_all_gathers_a_sequence_parallel_layers_inputs_in_one_byte(monkeypatch):
    gathers, scatters = _recording(monkeypatch, "all_gather"), _recording(monkeypatch,
                                                                          "reduce_scatter")
    layout = Layout(8, 1, 1, 1, 2, "none", True, "1f1b", False)
    Costs(LLAMA, H100, layout, Batch(2, 2048, "fp8", True, framework("nemo"))).layer(False)
    T = 2 * 2048  # (each priced twice: blocking, and overlapped with its GEMMs)
    assert gathers == [T * 1024 * 1] * 2  # 8-bit before the column-parallel GEMMs
    assert scatters == [T * 1024 * 2] * 2  # 16-bit after the row-parallel ones
    gathers.clear()
    Costs(LLAMA, H100, layout, Batch(2, 2048, "bf16", True, framework("nemo"))).layer(False)
    assert gathers == []  # 16-bit: priced as all-reduces of the same bytes


def test_a_fused_gate_keeps_its_two_inputs_and_eager_pytorch_also_silus_output():
    from pyplan.cluster.memory import activations

    layout = Layout(1, 1, 8, 1, 2, "none", False, "1f1b", False)
    fused = activations(LLAMA, layout, Batch(16, 2048, "bf16", True, framework("megatron")),
                        False)
    eager = activations(LLAMA, layout, Batch(16, 2048, "bf16", True,
                                             framework("torchtitan", fused_kernels=False)),
                        False)
    assert eager.held - fused.held == 2 * 2048 * 2816 * 2  # one inner-width tensor, bf16
    assert eager.weight_held == fused.weight_held  # the down projection's input, either way


def test_block_recompute_reruns_and_keeps_only_the_input_of_each_chunks_first_layers():
    """Megatron-LM's --recompute-method block: in each model chunk the first N layers keep
    their input and rerun their forward in the backward, the others keep everything."""
    from pyplan.cluster.memory import activations
    from pyplan.cluster.pipeline import chunks

    model = replace(LLAMA, layers=8)
    batch = Batch(8, 2048, "bf16")
    block = Layout(1, 2, 1, 1, 1, "block", schedule="1f1b", recompute_layers=3)
    plain, full = replace(block, recompute="none", recompute_layers=0), \
        replace(block, recompute="full", recompute_layers=0)
    kept = activations(model, plain, batch, False)
    rerun = activations(model, full, batch, False)
    layer = Costs(model, A100, plain, batch).layer(False)
    by = {layout.recompute: chunks(model, A100, layout, batch, (4, 4))
          for layout in (block, plain)}
    for mine, none in zip(by["block"], by["none"]):
        assert mine.held - none.held == pytest.approx(3 * (rerun.held - kept.held))
        assert mine.weight_held == pytest.approx(none.weight_held - 3 * kept.weight_held)
        assert mine.backward.seconds - none.backward.seconds == pytest.approx(
            3 * layer.forward.seconds)
    assert check_layout(replace(block, recompute_layers=0), model, batch, 2, 8) == \
        "block recomputation needs the layers per chunk it recomputes (--recompute-layers N)"


def test_the_search_recomputes_the_fewest_layers_per_chunk_that_fit():
    from pyplan.cluster import Fixed, predict, search

    model = Transformer(family="llama", layers=16, hidden=4096, heads=32, kv_heads=32,
                        head_dim=128, ffn=11008, vocab=32000, gated=True, norm="rmsnorm",
                        biases=False)
    batch = Batch(32, 8192, "bf16")
    fixed = Fixed(tp=1, pp=1, cp=1, micro_batch=2, recompute="block")
    (best,), _, _ = search(model, A100, batch, 8, fixed)
    n = best.layout.recompute_layers
    assert 1 < n < 16 and best.fits
    assert not predict(model, A100, replace(best.layout, recompute_layers=n - 1), batch).fits
    full = predict(model, A100, replace(best.layout, recompute="full", recompute_layers=0),
                   batch)
    assert full.fits and full.seconds > best.seconds
    rerun = (best.hfu - best.mfu) * best.seconds * 8 * A100.gpu.peak("bf16") / (32 * 8192)
    assert rerun == pytest.approx(n * (2 * model.layer_active_params(False) +
                                       4 * model.q_dim * 8192))  # FLOPs per token


def test_block_recompute_is_fixed_on_the_command_line_and_exported_to_megatron(tmp_path,
                                                                               capsys):
    argv = ["plan", _config(tmp_path), "--cluster", "dgx-a100-80gb", "--gpus", "8",
            "--global-batch", "16", "--seq", "2048", "--tp", "2", "--pp", "2",
            "--micro-batch", "1", "--recompute-layers", "1", "--megatron", "-", "--json"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    line = [x for x in out.splitlines() if not x.startswith("#")][0].split()
    assert line[line.index("--recompute-method") + 1] == "block"
    assert line[line.index("--recompute-num-layers") + 1] == "1"
    layout = json.loads(out.splitlines()[-1])["layout"]
    assert (layout["recompute"], layout["recompute_layers"]) == ("block", 1)
    assert main(argv[:-3] + ["--recompute", "full"]) == 2
    assert "--recompute-layers needs --recompute block" in capsys.readouterr().err
    too_many = argv[:-3]
    too_many[too_many.index("--recompute-layers") + 1] = "9"
    assert main(too_many) == 2
    assert "more than the model's 8 layers" in capsys.readouterr().err


def test_megatrons_input_gradient_collectives_run_beside_the_weight_gradient_gemms():
    """tp 8: in the backward, QKV's and the first MLP matrix's input-gradient all-reduce runs
    beside the same linear's weight-gradient GEMM (Megatron-Core's async dgrad); only what
    outlasts the GEMM, and the SMs NCCL holds meanwhile, is exposed. With sequence parallelism
    the reduce-scatter overlaps and the all-gather of the incoming gradient blocks. torchtitan
    and the zero-bubble schedules (W deferred) block on both."""
    layout = Layout(8, 1, 1, 1, 4, "none", False, "1f1b", False)
    batch = Batch(4, 2048, "bf16", True, framework("megatron"))
    costs = Costs(LLAMA, A100, layout, batch)
    T, h = 4 * 2048, 1024
    nbytes = T * h * 2
    windows = [costs.linear(h, 1024 / 8 + 2 * 256 / 8, T), costs.linear(h, 2 * 2816 / 8, T)]
    # (beside the GEMM at its overlapped rate, after it at its own)
    alone, beside = (collectives.all_reduce(A100, nbytes, 8, 8, o) for o in (False, True))
    expected = sum((1 - min(1, w / beside)) * alone + min(beside, w) * 16 / A100.gpu.sms
                   for w in windows)
    assert costs.layer(False).backward.parts["tp_comm"] == pytest.approx(expected)
    blocking = 2 * alone
    assert expected < blocking
    for other in (Costs(LLAMA, A100, layout, replace(batch, framework=framework("torchtitan"))),
                  Costs(LLAMA, A100, replace(layout, schedule="zb-h1"), batch)):
        assert other.layer(False).backward.parts["tp_comm"] == pytest.approx(blocking)
    sp = Costs(LLAMA, A100, replace(layout, sequence_parallel=True), batch)
    gathers = 2 * collectives.all_gather(A100, nbytes, 8, 8)
    alone, beside = (collectives.reduce_scatter(A100, nbytes, 8, 8, o) for o in (False, True))
    assert sp.layer(False).backward.parts["tp_comm"] == pytest.approx(gathers + sum(
        (1 - min(1, w / beside)) * alone + min(beside, w) * 16 / A100.gpu.sms
        for w in windows))
