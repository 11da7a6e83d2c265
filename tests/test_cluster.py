"""`pyplan plan`'s cost model against its oracles: parameter counts against the model
transformers builds (on the meta device), activation bytes against Korthikanti et al.'s closed
forms, model FLOPs against the 72-based formula, pipeline makespans against the closed forms
of 1F1B and interleaved 1F1B, the search's pruning against pricing every candidate; the command's
output, its plan file, its errors and its determinism."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings
from dataclasses import replace

import pytest

from pyplan.cluster import Batch, Fixed, Layout, load_cluster, predict, search
from pyplan.cluster.costs import Costs
from pyplan.cluster.memory import activations, state_bytes_per_parameter
from pyplan.cluster.model import from_config, gpt
from pyplan.cluster.pipeline import chunks, price
from pyplan.cluster.search import candidates
from pyplan.cli import main

A100 = load_cluster("dgx-a100-80gb")
PYPLAN = [sys.executable, "-m", "pyplan"]

SMALL = {
    "gpt2": dict(n_embd=256, n_layer=3, n_head=4, vocab_size=1000, n_positions=128),
    "llama": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                  num_attention_heads=8, num_key_value_heads=2, vocab_size=1000),
    "mistral": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                    num_attention_heads=8, num_key_value_heads=2, vocab_size=1000),
    "qwen2": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                  num_attention_heads=8, num_key_value_heads=2, vocab_size=1000),
    "mixtral": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                    num_attention_heads=8, num_key_value_heads=2, vocab_size=1000,
                    num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                      shared_expert_intermediate_size=256, num_hidden_layers=3,
                      num_attention_heads=8, num_key_value_heads=2, vocab_size=1000,
                      num_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                      num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                      vocab_size=1000, num_experts=4, num_experts_per_tok=2, head_dim=32),
    "gpt_neox": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=3,
                     num_attention_heads=8, vocab_size=1000),
    "nemotron": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=3,
                     num_attention_heads=8, num_key_value_heads=2, vocab_size=1000),
}


def test_grok_1s_config_is_a_mixture_of_316b_parameters_84b_of_them_active():
    """Grok-1 as its Hugging Face port's config.json gives it (no transformers class): 64
    layers of 6,144 with 48 query and 8 key/value heads of 128, 8 gated experts of 32,768
    (top 2), a 131,072-token vocabulary tied to the output: 316B parameters, 84B active."""
    grok = from_config({"model_type": "grok-1", "hidden_size": 6144, "intermediate_size": 32768,
                        "num_hidden_layers": 64, "num_attention_heads": 48,
                        "num_key_value_heads": 8, "num_experts": 8, "num_experts_per_tok": 2,
                        "vocab_size": 131072, "max_position_embeddings": 8192,
                        "tie_word_embeddings": True})
    attention = 2 * 6144 * 6144 + 2 * 6144 * 1024
    expert = 3 * 6144 * 32768
    layer = attention + 8 * expert + 6144 * 8 + 2 * 6144  # the router, two RMSNorms
    assert grok.params == pytest.approx(64 * layer + 131072 * 6144, rel=1e-3)
    assert grok.params / 1e9 == pytest.approx(316, abs=1)
    assert grok.active_params == pytest.approx(64 * (layer - 6 * expert) + 131072 * 6144,
                                               rel=1e-3)
    assert (grok.experts, grok.top_k, grok.moe_layers, grok.gated) == (8, 2, 64, True)


def test_a_family_transformers_does_not_know_is_read_from_its_own_config(tmp_path, capsys):
    """Grok-1's port has no transformers class: its config.json is read as it is (it was
    refused with transformers' list of its ~900 families on one line)."""
    config = {"model_type": "grok-1", "hidden_size": 512, "intermediate_size": 1024,
              "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
              "num_experts": 8, "num_experts_per_tok": 2, "vocab_size": 1000}
    (tmp_path / "config.json").write_text(json.dumps(config))
    argv = ["plan", str(tmp_path), "--cluster", "dgx-h100", "--gpus", "8", "--global-batch",
            "16", "--seq", "2048", "--ep", "8", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"]["family"] == "grok-1" and report["layout"]["ep"] == 8


@pytest.mark.parametrize("family", sorted(SMALL))
def test_parameters_are_those_of_the_model_transformers_builds(family):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = transformers.AutoConfig.for_model(family, **SMALL[family])
        with torch.device("meta"):
            built = transformers.AutoModelForCausalLM.from_config(config)
    real = sum(p.numel() for p in built.parameters())
    ours = from_config({**config.to_dict(), "model_type": family})
    assert ours.params == pytest.approx(real, rel=2e-3)  # (biases of q, k, v only: qwen2)


@pytest.mark.parametrize("t, recompute, sp", [
    (t, recompute, sp) for t in (1, 2, 4, 8)
    for recompute, sp in (("none", False), ("none", True), ("selective", False),
                          ("selective", True), ("full", False))
    if t > 1 or not sp])  # (sequence parallelism needs tensor parallelism)
def test_activation_bytes_are_korthikanti_et_al(t, recompute, sp):
    s, b, h, a = 2048, 2, 4096, 32
    model = gpt(8, h, a, sequence=s)
    layout = Layout(t, 1, 1, 1, b, recompute, sp, "1f1b", False)
    held = activations(model, layout, Batch(b, s, "bf16", flash_attention=False), False).held
    sbh, scores = s * b * h, 5 * a * s * s * b
    expected = {("none", False): sbh * (10 + 24 / t) + scores / t,
                ("none", True): (34 * sbh + scores) / t,
                ("selective", False): sbh * (10 + 24 / t),
                ("selective", True): 34 * sbh / t,
                ("full", False): 2 * sbh}[(recompute, sp)]
    assert held == pytest.approx(expected)


def test_state_bytes_per_parameter_are_the_mixed_precision_counts():
    assert sum(state_bytes_per_parameter("bf16").values()) == 18
    assert sum(state_bytes_per_parameter("bf16", shards=8).values()) == 6 + 12 / 8
    assert sum(state_bytes_per_parameter("fp16").values()) == 20
    assert sum(state_bytes_per_parameter("fp16", shards=4).values()) == 4 + 16 / 4
    assert sum(state_bytes_per_parameter("fp32").values()) == 16


def test_model_flops_are_the_72_formula():
    l, h, s, V = 96, 12288, 2048, 51200
    model = gpt(l, h, 96, vocab=V, sequence=s)
    per_token = 72 * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h)) / s
    # (the formula leaves out biases and norms: a few parts per million)
    assert model.model_flops(s) == pytest.approx(per_token, rel=1e-3)


def test_a_ring_all_reduce_moves_2_n_minus_1_over_n_of_the_bytes():
    from pyplan.cluster import collectives

    inside = collectives.all_reduce(A100, 1e9, 8, 8) - collectives.all_reduce(A100, 0.5e9, 8, 8)
    rate = A100.link_gbs * 1e9 * A100.link_efficiency
    assert inside == pytest.approx(2 * 7 / 8 * 0.5e9 / rate)
    # One GPU per node in the group: one network port's share; eight: the node's eight.
    one = collectives.all_reduce(A100, 2e9, 16, 1) - collectives.all_reduce(A100, 1e9, 16, 1)
    assert one == pytest.approx(2 * 15 / 16 * 1e9 / (25e9 * A100.network_efficiency))
    eight = collectives.all_reduce(A100, 2e9, 16, 8) - collectives.all_reduce(A100, 1e9, 16, 8)
    assert eight == pytest.approx(2 * 15 / 16 * 1e9 / (8 * 25e9 * A100.network_efficiency))


@pytest.mark.parametrize("sp", [False, True])
def test_a_moe_layer_under_tensor_parallelism_is_each_ranks_slice_of_every_expert(
        monkeypatch, sp):
    """At tensor degree t a rank runs 1/t of attention and of every expert's three GEMMs (its
    slice of the inner width, for the expert's share of the routed tokens) and the whole
    router; it sends the MLP's collectives (two of the layer's activations each way) and, in
    the backward, the sum of the routing weights' gradient (fp32, top-k per token)."""
    from pyplan.cluster.model import Transformer

    h, q, kv, d, E, k, f, b, s, t = 1024, 1024, 256, 64, 8, 2, 2048, 2, 512, 4
    model = Transformer(family="mixtral", layers=2, hidden=h, heads=q // d, kv_heads=kv // d,
                        head_dim=d, ffn=4096, vocab=32000, gated=True, norm="rmsnorm",
                        biases=False, experts=E, top_k=k, expert_ffn=f, moe_layers=2)
    flops = []
    monkeypatch.setattr(Costs, "gemm", lambda self, m, n, k_, count=1.0, fp8=False:
                        flops.append(2 * m * n * k_ * count) or 0.0)
    layout = Layout(t, 1, 1, 1, b, "none", sp, "1f1b", False)
    layer = Costs(model, A100, layout, Batch(b, s, "bf16", flash_attention=False)).layer(True)
    T = b * s
    weights = 2 * T * ((h * (q + 2 * kv) + q * h) / t  # q, k, v and out, each rank's heads
                       + E * h                          # the router, whole
                       + k * 3 * h * f / t)             # each token's k experts, 1/t of each
    scores = 2 * 2 * b * (q // d / t) * s * s * d      # QK^T and PV of each rank's heads
    assert sum(flops) == pytest.approx(3 * weights + scores)  # F, B and W of each weight
    from pyplan.cluster.collectives import all_gather, all_reduce, reduce_scatter

    def reduced(nbytes):
        return all_reduce(A100, nbytes, t, t)
    assert layer.forward.parts["tp_comm"] == pytest.approx(2 * reduced(T * h * 2))
    # (the backward's: with sequence parallelism an all-gather and a reduce-scatter apiece,
    # the weight-gradient GEMMs they would run beside taking no time here)
    each = all_gather(A100, T * h * 2, t, t) + reduce_scatter(A100, T * h * 2, t, t) if sp \
        else reduced(T * h * 2)
    assert layer.backward.parts["tp_comm"] == pytest.approx(2 * each + reduced(T * k * 4))


def _uniform(layout: Layout, m: int):
    """A GPT whose stages all hold the same layers and no ends (as in the closed forms)."""
    model = gpt(16, 1024, 16, sequence=1024)
    batch = Batch(m * layout.micro_batch, 1024, "bf16")
    chunk_list = chunks(model, A100, layout, batch, (16 // layout.stages,) * layout.stages)
    layer = Costs(model, A100, layout, batch).layer(False)
    return chunk_list, layer


@pytest.mark.parametrize("p, v, m", [(4, 1, 8), (4, 2, 8), (8, 2, 16), (4, 4, 8)])
def test_pipeline_makespans_meet_the_closed_forms(p, v, m):
    schedule = "1f1b" if v == 1 else "interleaved-1f1b"
    layout = Layout(1, p, 1, v, 1, "none", False, schedule, False)
    chunk_list, layer = _uniform(layout, m)
    # Take the ends out so that every chunk costs the same.
    middle = chunk_list[1]
    same = [replace(middle, index=c.index, device=c.device, send=0.0) for c in chunk_list]
    priced = price(same, layout, m, None)
    f = middle.forward.seconds
    fb = f + middle.backward.seconds + middle.weight.seconds
    ideal = m * v * fb  # every chunk's F, B and W on every device
    bubble = (p - 1) * fb  # (p - 1)(F + B) of one chunk: (p - 1)/(v m) of the ideal
    assert priced.makespan == pytest.approx(ideal + bubble, rel=2e-3)
    assert (priced.makespan - ideal) / ideal == pytest.approx((p - 1) / (v * m), rel=5e-3)


@pytest.mark.parametrize("model, batch, gpus, fixed", [
    (gpt(8, 1024, 16, sequence=1024), Batch(32, 1024, "bf16"), 16, Fixed()),
    # memory binds: block recomputation of a few layers wins
    (gpt(16, 4096, 32, sequence=8192), Batch(32, 8192, "bf16"), 8, Fixed(tp=1, pp=1)),
    # a pipeline whose fitting block recomputations rerun half of each chunk
    (gpt(32, 4096, 32, sequence=16384), Batch(16, 16384, "bf16"), 8, Fixed(tp=1, pp=2))])
def test_the_search_finds_what_pricing_every_candidate_finds(model, batch, gpus, fixed):
    cluster = load_cluster("dgx-a100-80gb")
    everything = candidates(model, cluster, batch, gpus, fixed)
    priced = []
    for layout in everything:
        if layout.recompute != "block":
            priced.append(predict(model, cluster, layout, batch))
            continue
        # every count of layers per chunk: the fastest that fits stands for the layout
        tries = [predict(model, cluster, replace(layout, recompute_layers=n), batch)
                 for n in range(1, -(-model.layers // layout.stages))]
        fit = [p for p in tries if p.fits]
        priced.append(min(fit, key=lambda p: p.seconds) if fit else tries[0])
    fits = {(replace(p.layout, recompute="none", recompute_layers=0), p.layout.recompute)
            for p in priced if p.fits}
    # (a layout is not listed beside the same one recomputing less that fits: never faster)
    less = {"none": (), "selective": ("none",), "block": ("none",),
            "full": ("none", "selective", "block")}
    fitting = sorted((p for p in priced if p.fits and not any(
        (replace(p.layout, recompute="none", recompute_layers=0), r) in fits
        for r in less[p.layout.recompute])), key=lambda p: p.seconds)
    best, count, exact = search(model, cluster, batch, gpus, fixed, top=3)
    assert count == len(everything) and exact < count
    assert [b.seconds for b in best] == pytest.approx([p.seconds for p in fitting[:3]])
    assert [b.layout for b in best] == [p.layout for p in fitting[:3]]


def test_a_fixed_layout_that_does_not_fit_is_predicted_and_said(tmp_path):
    config = _config(tmp_path, "gpt2", n_embd=8192, n_layer=48, n_head=64, vocab_size=51200,
                     n_positions=2048)
    result = _pyplan("plan", config, "--cluster", "dgx-a100-80gb", "--gpus", "8",
                     "--global-batch", "64", "--seq", "2048", "--tp", "1", "--pp", "1",
                     "--dp", "8", "--micro-batch", "8", "--recompute", "none", "--schedule",
                     "1f1b", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["fits"] is False and report["memory_bytes_per_gpu"] > 80 * 2**30


def _config(tmp_path, family: str, **sizes) -> str:
    transformers = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.AutoConfig.for_model(family, **sizes).save_pretrained(tmp_path / family)
    return str(tmp_path / family / "config.json")


def _pyplan(*args, cwd, env=None):
    return subprocess.run([*PYPLAN, *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, **(env or {})}, timeout=300)


LLAMA = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
             num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)


def test_plan_prints_the_best_layouts_and_writes_a_plan_solve_takes(tmp_path):
    config = _config(tmp_path, "llama", **LLAMA)
    result = _pyplan("plan", config, "--cluster", "dgx-h100", "--gpus", "64",
                     "--global-batch", "512", "--seq", "4096", "--top", "3", "-o",
                     "llama.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("llama (") and "64 GPUs of dgx-h100" in lines[0]
    assert any(line.startswith("best: tp ") for line in lines)
    assert "top 3:" in result.stdout and "wrote llama.yaml" in result.stdout
    plan = (tmp_path / "llama.yaml").read_text()
    assert plan.startswith("# Written by pyplan plan: llama on 64 GPUs of dgx-h100")
    solved = _pyplan("solve", "llama.yaml", "--json", cwd=tmp_path)
    assert solved.returncode == 0, solved.stderr
    for command in (["validate", "llama.yaml"], ["show", "llama.resolved.yaml", "--width",
                                                 "80"],
                    ["export", "llama.resolved.yaml", "--format", "chrome", "-o", "t.json"]):
        done = _pyplan(*command, cwd=tmp_path)
        assert done.returncode == 0, (command, done.stderr)


def test_plan_json_has_the_contracted_keys_and_is_the_same_under_any_hash_seed(tmp_path):
    config = _config(tmp_path, "mixtral", hidden_size=1024, intermediate_size=3584,
                     num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                     num_local_experts=8, num_experts_per_tok=2, vocab_size=32000)
    args = ("plan", config, "--cluster", "dgx-a100-80gb", "--gpus", "16", "--global-batch",
            "64", "--seq", "2048", "--json", "-o", "a.yaml")
    outputs = []
    for seed, name in (("1", "a.yaml"), ("2", "b.yaml")):
        result = _pyplan(*args[:-1], name, cwd=tmp_path, env={"PYTHONHASHSEED": seed})
        assert result.returncode == 0, result.stderr
        report = json.loads(result.stdout)
        report["search"].pop("seconds")
        outputs.append((report, (tmp_path / name).read_bytes()))
    assert outputs[0] == outputs[1]
    report = outputs[0][0]
    assert set(report["layout"]) == {"tp", "pp", "dp", "vpp", "micro_batch", "recompute",
                                     "sequence_parallel", "schedule", "distributed_optimizer",
                                     "cp", "ep", "fsdp", "dp_replicate", "recompute_layers"}
    for key in ("iteration_seconds", "tokens_per_second_per_gpu", "mfu", "hfu",
                "memory_bytes_per_gpu", "fits"):
        assert key in report
    assert set(report["memory_breakdown"]) == {"weights", "gradients", "optimizer",
                                               "activations", "buffers"}
    assert set(report["breakdown"]) == {"compute", "tp_communication", "cp_communication",
                                        "ep_communication", "fsdp_communication",
                                        "pp_communication", "pipeline_bubble",
                                        "dp_communication", "optimizer"}
    assert sum(report["breakdown"].values()) == pytest.approx(report["iteration_seconds"],
                                                              rel=0.02)
    assert 0 < report["mfu"] <= report["hfu"] < 1


@pytest.mark.parametrize("arguments, message", [
    (["--tp", "3"], "--tp 3: 32 attention heads do not divide over 3 GPUs"),
    (["--tp", "2", "--pp", "2", "--dp", "2"],
     "--tp 2 x --cp 1 x --pp 2 x --dp 2 = 8 GPUs, not the 16"),
    (["--dp", "3"], "the fixed degrees (3 GPUs) do not divide 16 GPUs"),
    (["--gpus", "12"], "--gpus 12 is not a whole number of nodes of 8 GPUs"),
    (["--micro-batch", "0"], "--micro-batch must be an integer in 1 .. 1,000,000, got 0"),
    (["--tp", "12"], "--tp 12: 32 attention heads do not divide"),
    (["--cp", "2", "--seq", "2046"], "--cp 2: a sequence of 2046 does not split into 4 chunks"),
    (["--cp", "0"], "--cp must be an integer in 1 .. 1,000,000, got 0"),
    (["--ep", "-2"], "--ep must be an integer in 1 .. 1,000,000, got -2"),
    (["--ep", "2"], "--ep 2: llama is not a mixture of experts"),
    (["--dp-replicate", "2"], "--dp-replicate 2 needs --fsdp"),
    (["--dp-replicate", "3", "--fsdp", "--dp", "4"], "--dp-replicate 3: the data-parallel ranks"),
    (["--fsdp", "--distributed-optimizer"], "--fsdp with --distributed-optimizer"),
    (["--dtype", "fp8"], "--dtype fp8: A100-SXM4-80GB has no fp8 tensor cores"),
    (["--cp", "nan"], "--cp: invalid int value: 'nan'"),
    (["--gpus", "99999999999"], "--gpus must be an integer in 1 .. 1,000,000"),
    (["--global-batch", "30", "--dp", "4"], "--global-batch 30 does not split over --dp 4"),
    (["--tp", "2", "--pp", "2", "--dp", "4", "--micro-batch", "1", "--recompute", "none",
      "--schedule", "interleaved-1f1b", "--vpp", "1"],
     "the layout given cannot run: interleaved-1f1b needs 2 or more chunks per GPU (--vpp)"),
])
def test_bad_layouts_get_one_line_naming_the_flag(tmp_path, arguments, message, capsys):
    config = _config(tmp_path, "llama", **LLAMA)
    argv = ["plan", config, "--cluster", "dgx-a100-80gb", "--gpus", "16", "--global-batch",
            "64", "--seq", "2048", *arguments]
    # the last --gpus/--global-batch given wins, as argparse does
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("text, message", [
    ("gpu: {name: x, peak_tflops: {bf16: 1}, memory_gib: 80}\nnode: {gpus: 8, link_gbs: 1}\n"
     "network: {gbs_per_gpu: 1}\n", "missing required key 'memory_bandwidth_gbs' in gpu"),
    ("gpu: {name: x, peak_tflops: {bf16: -1}, memory_gib: 80, memory_bandwidth_gbs: 1}\n"
     "node: {gpus: 8, link_gbs: 1}\nnetwork: {gbs_per_gpu: 1}\n",
     "gpu.peak_tflops.bf16 must be >= 0.001"),
    ("gpu: {name: x, peak_tflops: {bf16: 1}, memory_gib: 80, memory_bandwidth_gbs: 1}\n"
     "node: {gpus: 8, link_gb: 1}\nnetwork: {gbs_per_gpu: 1}\n", "unknown key 'link_gb'"),
])
def test_a_bad_cluster_file_gets_one_line_at_its_position(tmp_path, text, message, capsys):
    config = _config(tmp_path, "llama", **LLAMA)
    (tmp_path / "c.yaml").write_text(text)
    assert main(["plan", config, "--cluster", str(tmp_path / "c.yaml"), "--gpus", "8",
                 "--global-batch", "8", "--seq", "512"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{tmp_path / 'c.yaml'}:") and message in err, err


def test_an_unsupported_model_type_is_named(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    assert main(["plan", str(tmp_path), "--cluster", "dgx-h100", "--gpus", "8",
                 "--global-batch", "8", "--seq", "512"]) == 2
    err = capsys.readouterr().err
    assert "model_type 'deepseek_v3' has multi-head latent attention" in err
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert main(["plan", str(tmp_path), "--cluster", "dgx-h100", "--gpus", "8",
                 "--global-batch", "8", "--seq", "512"]) == 2
    assert "model_type 'bert' is not a family pyplan plan knows" in capsys.readouterr().err


def test_gpt3_on_512_gpus_searches_everything_in_seconds():
    model = gpt(96, 12288, 96, sequence=2048)
    cluster = replace(A100, nodes=64)
    best, count, exact = search(model, cluster, Batch(1536, 2048, "bf16"), 512, Fixed(),
                                top=1)
    assert count > 1000 and exact < 100 and best[0].fits
    assert 0.3 < best[0].mfu < 0.8 and not math.isnan(best[0].seconds)


def test_plan_writes_the_layout_for_torchtitan_and_megatron(tmp_path):
    config = _config(tmp_path, "llama", **LLAMA)
    result = _pyplan("plan", config, "--cluster", "dgx-a100-80gb", "--gpus", "64",
                     "--global-batch", "512", "--seq", "4096", "--tp", "2", "--pp", "4",
                     "--schedule", "interleaved-1f1b", "--vpp", "2", "--torchtitan", "tt.py",
                     "--megatron", "megatron.txt", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    layout = json.loads(result.stdout)["layout"]
    line = (tmp_path / "megatron.txt").read_text().splitlines()[-1]
    assert f"--tensor-model-parallel-size {layout['tp']}" in line
    assert "--pipeline-model-parallel-size 4" in line and "--global-batch-size 512" in line
    module = (tmp_path / "tt.py").read_text()
    assert "parallelism.tensor_parallel_degree = 2" in module
    assert "Interleaved1F1B" in module
    # Megatron-LM has no zero-bubble schedule: one line, nothing written
    refused = _pyplan("plan", config, "--cluster", "dgx-a100-80gb", "--gpus", "64",
                      "--global-batch", "512", "--seq", "4096", "--schedule", "zb-h1",
                      "--megatron", "zb.txt", cwd=tmp_path)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert not (tmp_path / "zb.txt").exists()


def test_a_cluster_of_sixteen_thousand_gpus_is_planned_and_its_plan_validates(tmp_path):
    """Llama 3 405B's published layout (Dubey et al. 2024: 16,384 H100s, tp 8 x pp 16 x dp
    128): the plan's mesh is 16,384 GPUs, within the 1,048,576 a plan allows (4,096 before)."""
    config = _config(tmp_path, "llama", hidden_size=16384, intermediate_size=53248,
                     num_hidden_layers=126, num_attention_heads=128, num_key_value_heads=8,
                     vocab_size=128256)
    result = _pyplan("plan", config, "--cluster", "dgx-h100", "--gpus", "16384", "--tp", "8",
                     "--pp", "16", "--dp", "128", "--global-batch", "2048", "--seq", "8192",
                     "--micro-batch", "1", "--framework", "nemo", "--json", "-o",
                     "l405.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    layout = json.loads(result.stdout)["layout"]
    assert (layout["tp"], layout["pp"], layout["dp"]) == (8, 16, 128)
    assert "mesh: {data: 128, " in (tmp_path / "l405.yaml").read_text()
    validated = _pyplan("validate", "l405.yaml", cwd=tmp_path)
    assert validated.returncode == 0, validated.stderr


def _plan_json(capsys, config, *args):
    code = main(["plan", config, "--cluster", "dgx-a100-80gb", "--gpus", "64",
                 "--global-batch", "512", "--seq", "2048", "--json", *args])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


def test_a_switch_not_given_is_the_frameworks_own_default(tmp_path, capsys):
    """A published Megatron-LM run fixed by its degrees alone is priced as Megatron-LM runs it
    without further flags: 1F1B with one chunk, no sequence parallelism, no distributed
    optimizer, and in fp16 its scores through memory; NeMo's recipes turn those on; --cp
    needs fused attention; no framework searches a schedule it does not run."""
    config = _config(tmp_path, "gpt2", n_embd=3072, n_layer=30, n_head=32, n_positions=2048,
                     vocab_size=51200)
    fixed = ("--tp", "4", "--pp", "2", "--micro-batch", "4", "--recompute", "full")
    plain = _plan_json(capsys, config, "--dtype", "fp16", *fixed)
    spelled = _plan_json(capsys, config, "--dtype", "fp16", *fixed, "--schedule", "1f1b",
                         "--vpp", "1", "--no-sequence-parallel", "--no-distributed-optimizer",
                         "--no-flash-attention")
    assert plain == {**spelled, "search": plain["search"]}
    layout = plain["layout"]
    assert (layout["schedule"], layout["vpp"], layout["sequence_parallel"],
            layout["distributed_optimizer"], plain["batch"]["flash_attention"]) == \
        ("1f1b", 1, False, False, False)
    assert _plan_json(capsys, config, "--dtype", "bf16", *fixed)["batch"]["flash_attention"]
    nemo = _plan_json(capsys, config, "--framework", "nemo", "--dtype", "fp16", *fixed)
    assert (nemo["layout"]["sequence_parallel"], nemo["layout"]["distributed_optimizer"],
            nemo["batch"]["flash_attention"]) == (True, True, True)
    cp = _plan_json(capsys, config, "--dtype", "fp16", "--cp", "2", "--tp", "2")
    assert cp["batch"]["flash_attention"] and cp["layout"]["cp"] == 2
    for name in ("megatron", "nemo", "megatron-deepspeed", "torchtitan"):
        report = _plan_json(capsys, config, "--framework", name, "--top", "50", "--tp", "8",
                            "--micro-batch", "2")
        schedules = {row["layout"]["schedule"] for row in report["top"]}
        runs = {"torchtitan": {"1f1b", "interleaved-1f1b", "zb-v"},
                "megatron-deepspeed": {"1f1b"}}.get(name, {"1f1b", "interleaved-1f1b"})
        assert schedules <= runs, (name, schedules)
