// Fast path of the search: a repetend as a modulo schedule (Rau's iterative modulo scheduling,
// DESIGN.md "Search at scale"). Block b of micro-batch m starts at start[b] + m * period; blocks
// sharing a device must not overlap modulo the period. A depth-first search over each block's
// offset in [0, period) with a modulo reservation table finds one, as-early-as-possible first,
// so lags (and with them memory and warmup length) stay small.
#pragma once

#include <cstdint>
#include <vector>

#include "core/graph.hpp"
#include "core/repetend.hpp"

namespace pyplan {

struct ModuloStats {
    int64_t nodes = 0;           // placements tried
    int64_t periods_tried = 0;
    bool budget_exhausted = false;
    // Elementary steps: placements, forward-checking packing steps and, for each complete
    // placement, the blocks x edges of its exact evaluation (a deterministic measure of work).
    int64_t work = 0;
};

// A modulo schedule with the given period whose repetend has at most max_micro_batches
// micro-batches and fits memory, or a Repetend with feasible == false (also when the node
// budget, the work budget (elementary steps, ModuloStats::work; <= 0: none) or, if
// seconds > 0, the time runs out: stats.budget_exhausted).
Repetend modulo_schedule(const Graph& g, int64_t period, int max_micro_batches,
                         int64_t memory_capacity, int64_t node_budget, ModuloStats& stats,
                         double seconds = 0, int64_t work_budget = 0);

// The repetend a modulo schedule (absolute starts of micro-batch 0) stands for: indices from the
// lags, per-device order by offset, evaluated exactly.
Repetend repetend_from_starts(const Graph& g, const std::vector<int64_t>& start, int64_t period);

}  // namespace pyplan
