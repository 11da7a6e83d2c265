// The stage-level programs behind the hand-written templates (1F1B and its memory-limited
// variant, Chimera, ZB-H1, ZB-H2, ZB-V) and their expansion into per-device instance orders.
// Python (pyplan/solver/templates.py) decides which template fits a placement and what its
// stages are; these loops run once per stage op, so with 1,024 micro-batches on 64 stages they
// are the part that must be fast. tests/template_reference.py is their plain-Python oracle.
#pragma once

#include <vector>

#include "core/evaluate.hpp"
#include "core/graph.hpp"

namespace pyplan {

// The blocks one op of a stage runs, in order: F its forwards, B its (input-)gradient blocks,
// W its weight-gradient blocks (none without a split backward).
struct StageBlocks {
    std::vector<int> forward, backward, weight;
};

// What a template produces: per-device orders, or ok == false when its program cannot make
// progress on this placement (the template does not apply).
struct TemplateOrders {
    bool ok = false;
    DeviceOrders orders;
};

// 1F1B with unit-time ops on each chain of stages (one chain: 1F1B, with at most limits[s]
// micro-batches in flight on stage s where limits is not empty; two chains: Chimera, the
// second's ops after the first's at the same step). Instances are ordered by their op's step,
// then chain, then position inside the stage, so every device agrees with one global order.
// weight_after[b] (when not empty): the W block run right after B block b, or -1.
TemplateOrders one_f_one_b_orders(const Graph& g,
                                  const std::vector<std::vector<StageBlocks>>& chains, int n,
                                  const std::vector<int>& limits,
                                  const std::vector<int>& weight_after);

// ZB-H1: 1F1B's F/B order with stage s running W(m) right after B(m + s), the last s W passes
// at the end; ops timed by a unit-time simulation of that program.
TemplateOrders zb_h1_orders(const Graph& g, const std::vector<StageBlocks>& stages, int n);

// Unit-time list scheduling of one chain of stages placed on devices (stage_device[s]): each
// step a device runs a ready B (latest stage first), else a ready F while it holds fewer than
// in_flight[d] stage activations (latest stage first), else a deferred W (oldest first). The
// program of simulated device p is laid out on device program_device[p].
TemplateOrders greedy_orders(const Graph& g, const std::vector<StageBlocks>& stages,
                             const std::vector<int>& stage_device, int n, bool split,
                             const std::vector<int>& in_flight,
                             const std::vector<int>& program_device);

}  // namespace pyplan
