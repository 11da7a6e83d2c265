"""`pyplan plan`: the layout, schedule, time and memory of a training run on a cluster that is
not here, from a model's config.json and a cluster's description.

The data flow: model (config.json -> Transformer) and cluster (YAML -> Cluster) -> layouts
(the degrees and settings left open) -> per-piece costs and memory (costs, memory) -> each
candidate's pipeline as a pyplan plan, its schedule laid out and evaluated by pyplan's own
templates (pipeline) -> the prediction (predict) -> the search's best (search).
"""

from __future__ import annotations

from pyplan.cluster.hardware import Cluster, load_cluster, preset_names
from pyplan.cluster.layout import RECOMPUTE, SCHEDULES, Batch, Layout
from pyplan.cluster.model import Transformer, read_model
from pyplan.cluster.predict import Prediction, predict
from pyplan.cluster.search import Fixed, search

__all__ = ["RECOMPUTE", "SCHEDULES", "Batch", "Cluster", "Fixed", "Layout", "Prediction",
           "Transformer", "load_cluster", "predict", "preset_names", "read_model", "search"]
