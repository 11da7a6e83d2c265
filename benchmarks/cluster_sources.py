"""The published runs of ../shared/cluster (or PYPLAN_CLUSTER_DATA) as rows `pyplan plan`'s cost
model predicts: each with its model, cluster, layout, batch and framework fixed as published,
and what was measured. benchmarks/cluster.py scores and fits on them.

Where a source leaves something out, the choice made here is the software's default and is
said where it is made (MPT's configs, torchtitan's pipeline micro-batch of 1, the 500 W power
cap of torchtitan's H100s).
"""

from __future__ import annotations

import csv
import os
import re
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path

from pyplan.cluster.framework import framework
from pyplan.cluster.hardware import Cluster, load_cluster
from pyplan.cluster.layout import Batch, Layout
from pyplan.cluster.model import Transformer, gpt

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("narayanan_sc21", "zero_bubble", "llm_foundry", "torchtitan_2412")
ZB_SCHEDULES = (("1f1b", "1f1b", 1), ("interleaved_1f1b", "interleaved-1f1b", 2),
                ("zb_1p", "zb-h1", 1), ("zb_2p", "zb-2p", 1))  # (CSV column, template, vpp)
POWER_CAP = 0.82
"""torchtitan's H100s ran at a 500 W limit (not the SXM part's 700 W): under dense GEMMs
their clock holds about 1.5 of the 1.83 GHz the 989 TFLOP/s peak is quoted at."""


def data_folder() -> Path:
    """PYPLAN_CLUSTER_DATA, else shared/cluster in the checkout, beside it (CI's read-only
    copy beside the clone), or beside the main worktree of a git worktree."""
    if os.environ.get("PYPLAN_CLUSTER_DATA"):
        return Path(os.environ["PYPLAN_CLUSTER_DATA"])
    places = [ROOT / "shared" / "cluster", ROOT.parent / "shared" / "cluster"]
    try:
        common = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--git-common-dir"],
                                capture_output=True, text=True, check=True).stdout.strip()
        places.append((ROOT / common).resolve().parent.parent / "shared" / "cluster")
    except (OSError, subprocess.CalledProcessError):
        pass
    for place in places:
        if (place / "narayanan_sc21.csv").is_file():
            return place
    return places[1]


DATA = data_folder()


@dataclass(frozen=True)
class Row:
    source: str
    group: str
    """Rows of one model (and GPU, sequence) whose layouts are ranked against each other."""
    label: str
    model: Transformer
    cluster: Cluster
    layout: Layout
    batch: Batch
    measured: float
    """Iteration seconds."""
    counts: tuple[int, ...] | None = None
    memory_gib: float | None = None
    """The measured peak of the fullest GPU's allocated memory, where published."""

    @property
    def tokens_per_gpu(self) -> float:
        return self.batch.global_batch * self.batch.sequence / self.layout.gpus


def read(name: str) -> list[dict]:
    with open(DATA / name, newline="") as f:
        lines = [line for line in f if line.strip() and not line.startswith("#")]
    return list(csv.DictReader(lines))


def sized(preset: str, gpus: int, **gpu) -> Cluster:
    cluster = load_cluster(preset)
    return replace(cluster, gpu=replace(cluster.gpu, **gpu),
                   nodes=max(1, -(-gpus // cluster.gpus_per_node)))


def ends_lighter(layers: int, stages: int) -> tuple[int, ...]:
    """The zero bubble paper's split: the first and last stages hold one layer fewer (where
    the stages hold more than one), what does not divide going to the middle stages."""
    lighter = (layers + 2) // stages >= 2
    base, extra = divmod(layers + (2 if lighter else 0), stages)
    counts = [base] * stages
    if lighter:
        counts[0] -= 1
        counts[-1] -= 1
    for s in range(extra):
        counts[1 + s % (stages - 2)] += 1
    return tuple(counts)


def narayanan() -> list[Row]:
    out = []
    for r in read("narayanan_sc21.csv"):
        layers, h, a, tp, pp, vpp, gpus, B, mb = (int(r[k]) for k in (
            "layers", "hidden", "heads", "tp", "pp", "vpp", "gpus", "global_batch",
            "micro_batch"))
        dp = gpus // (tp * pp)
        layout = Layout(tp, pp, dp, vpp, mb, "full", False,
                        "1f1b" if vpp == 1 else "interleaved-1f1b", False)
        out.append(Row("narayanan_sc21", "weak scaling", r["model"],
                       gpt(layers, h, a, vocab=51200, sequence=2048),
                       sized("dgx-a100-80gb", gpus), layout,
                       # (the 2021 release blocked on its pipeline sends and on the
                       # backward's tensor-parallel all-reduces: Megatron-LM overlapped the
                       # latter with the weight gradients from 2022, the interleaved
                       # schedule's sends with Megatron-Core, 2023)
                       Batch(B, 2048, "fp16", flash_attention=False,
                             framework=framework("megatron", overlap_p2p=False,
                                                 tp_dgrad_overlap=False)),
                       float(r["iteration_seconds"]), (layers // (pp * vpp),) * (pp * vpp)))
    return out


def zero_bubble() -> list[Row]:
    out = []
    for r in read("zero_bubble.csv"):
        layers, h, a, gpus, mb, m = (int(r[k]) for k in ("layers", "hidden", "heads", "gpus",
                                                        "micro_batch", "m"))
        model = gpt(layers, h, a, vocab=51200, sequence=1024)
        for column, schedule, vpp in ZB_SCHEDULES:
            layout = Layout(1, gpus, 1, vpp, mb, "none", False, schedule, False)
            batch = Batch(m * mb, 1024, "fp16", flash_attention=False)
            seconds = m * mb / (float(r[f"s_{column}"]) * gpus)
            out.append(Row("zero_bubble", f"{r['model']} m={m}", schedule, model,
                           sized("dgx-a100-80gb", gpus), layout, batch, seconds,
                           ends_lighter(layers, gpus) if vpp == 1 else None,
                           float(r[f"mem_{column}"])))
    return out


def _int(text: str) -> int:
    return int(re.match(r"\D*(\d+)", text).group(1))


def _recompute(text: str) -> str:
    return "full" if text.startswith("full") else \
        "selective" if text.startswith("selective") else "none"


def foundry() -> list[Row]:
    """MPT (llm-foundry's configs: no biases, LayerNorm, ALiBi, a GeLU MLP of 4h, tied
    embeddings) under FSDP (SHARD_GRAD_OP rows as FULL_SHARD: both prefetch and overlap
    their traffic) with flash attention, eager PyTorch (no torch.compile)."""
    presets = {"A100-40GB": ("dgx-a100-80gb", {"memory_gib": 40, "memory_bandwidth_gbs": 1555}),
               "A100-80GB": ("dgx-a100-80gb", {}), "H100-80GB": ("dgx-h100", {})}
    out = []
    for r in read("llm_foundry.csv"):
        gpu = next(k for k in presets if r["gpu_type"].startswith(k))
        preset, changes = presets[gpu]
        layers, h, ffn, heads, vocab, seq, gpus, mb, B = (_int(r[k]) for k in (
            "layers", "hidden", "ffn_hidden", "heads", "vocab", "seq_len", "num_gpus",
            "micro_batch", "global_batch_seqs"))
        model = Transformer(family="mpt", layers=layers, hidden=h, heads=heads,
                            kv_heads=_int(r["kv_heads"]), head_dim=h // heads, ffn=ffn,
                            vocab=vocab, gated=False, norm="layernorm", biases=False,
                            tied=True, alibi=True)
        dtype = "fp8" if r["precision"].startswith("fp8") else "bf16"
        layout = Layout(1, 1, gpus, 1, mb, _recompute(r["recompute"]), False, "1f1b", False,
                        fsdp=True)
        software = framework("torchtitan", fused_kernels=False)
        name = r["name"].split()[0]
        out.append(Row("llm_foundry", f"{name} {gpu} seq{seq} {dtype}", r["name"], model,
                       sized(preset, gpus, **changes), layout,
                       Batch(B, seq, dtype, True, software), float(r["iter_time_s"])))
    return out


def torchtitan() -> list[Row]:
    """Llama 3.1 (gated, RMSNorm, 8 key/value heads, untied) under FSDP2 with TP, PP and CP
    as published; under a pipeline, as many micro-batches as stages (torchtitan's default
    `pipeline_parallel_microbatches`), each a share of the rank's local batch."""
    out = []
    for r in read("torchtitan_2412.csv"):
        layers, h, ffn, heads, kv, vocab, seq, gpus, tp, pp, dp, cp = (_int(r[k]) for k in (
            "layers", "hidden", "ffn_hidden", "heads", "kv_heads", "vocab", "seq_len",
            "num_gpus", "TP", "PP", "DP", "CP"))
        local = _int(r["micro_batch"])
        B = _int(r["global_batch_seqs"])
        model = Transformer(family="llama", layers=layers, hidden=h, heads=heads,
                            kv_heads=kv, head_dim=h // heads, ffn=ffn, vocab=vocab,
                            gated=True, norm="rmsnorm", biases=False, tied=False)
        notes = r["notes"]
        software = framework("torchtitan", fused_kernels="compile=yes" in notes,
                             tp_comm_overlap="async TP" in notes)
        schedule = "interleaved-1f1b" if "Interleaved" in r["name"] else "1f1b"
        vpp = 2 if schedule == "interleaved-1f1b" else 1
        mb = max(1, local // pp) if pp > 1 else local
        if pp > 1 and vpp > 1 and (B // (dp * mb)) % pp:
            schedule, vpp = "1f1b", 1
        layout = Layout(tp, pp, dp, vpp, mb, _recompute(r["recompute"]), tp > 1, schedule,
                        False, cp=cp, fsdp=dp * cp > 1)
        dtype = "fp8" if r["precision"].startswith("fp8") else "bf16"
        cluster = sized("dgx-h100", gpus, memory_gib=96)
        peaks = {k: v * POWER_CAP for k, v in cluster.gpu.peak_tflops.items()}
        cluster = replace(cluster, gpu=replace(cluster.gpu, peak_tflops=peaks))
        name = r["name"].split()[1]
        out.append(Row("torchtitan_2412", name, r["name"], model, cluster, layout,
                       Batch(B, seq, dtype, True, software), float(r["iter_time_s"])))
    return out


def all_rows() -> list[Row]:
    return narayanan() + zero_bubble() + foundry() + torchtitan()
