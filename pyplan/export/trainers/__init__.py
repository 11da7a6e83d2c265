"""A pipeline layout in the formats other trainers read, so that what pyplan plans can drive
them: torchtitan's configuration (a Python module setting a Trainer.Config), Megatron-LM's
`--pipeline-model-parallel-layout` string and its `pretrain_gpt.py` argument line.

Each export is written for one released version of its client, stated in its header:
torchtitan 0.3.0, and megatron-core 0.16.1 with the Megatron-LM release cut beside it (tag
core_v0.16.1). tests/test_clients.py checks them with those releases' own code.

The exporters are functions of a `TrainerLayout`, plain data: the parallel degrees, the stages
(module names or decoder-layer counts), the micro-batches, the schedule and the settings that
change memory. `pyplan export --format torchtitan|megatron-layout|megatron-args` builds one
from a plan (`plan_layout`); the cluster planner builds one from its own layouts. A layout a
client cannot run is refused with one line saying why (a PlanError; from a plan, at its line).

pyplan's micro-batch count maps onto each client's own settings: torchtitan splits every
data-parallel rank's local batch into `local_batch_size // pipeline_parallel_microbatch_size`
micro-batches, so the export sets the local batch to micro-batches x micro-batch size;
Megatron-LM derives `global_batch_size // (micro_batch_size x data-parallel size)`, so the
export gives `--global-batch-size` as that product.

The modules: layout (TrainerLayout, plan_layout, the releases, the refusals), megatron and
torchtitan; this package lists their public names.
"""

from __future__ import annotations

from pyplan.export.trainers.layout import (MEGATRON_CORE, MEGATRON_LM, RECOMPUTE, SCHEDULES,
                                           TORCHTITAN, LayoutError, TrainerLayout,
                                           plan_layout)
from pyplan.export.trainers.megatron import megatron_argv, megatron_arguments, megatron_layout
from pyplan.export.trainers.torchtitan import torchtitan_config, torchtitan_fqns

__all__ = ["MEGATRON_CORE", "MEGATRON_LM", "RECOMPUTE", "SCHEDULES", "TORCHTITAN", "LayoutError",
           "TrainerLayout", "megatron_argv", "megatron_arguments", "megatron_layout",
           "plan_layout", "torchtitan_config", "torchtitan_fqns"]
