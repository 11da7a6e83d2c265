// Exhaustive search of a whole small problem (every instance of every micro-batch): is there a
// schedule whose makespan is at most a target? Proving that there is none is what makes a
// schedule optimal; Z3 can answer the same question (pyplan/solver/exact.py) but on problems
// of a few dozen instances its start-up costs more than this search.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "core/graph.hpp"

namespace pyplan {

struct ExhaustiveResult {
    enum Status { kNone = 0, kFound = 1, kUnknown = 2 };
    Status status = kUnknown;   // none: no schedule within the target; unknown: out of nodes
    std::vector<int64_t> start;  // found: [mb * K + block]
    int64_t nodes = 0;           // search nodes visited (a deterministic measure of work)
};

// Schedules of n micro-batches with makespan <= target, where the makespan is the end of the
// last block, and for every block that is not a forward one (is_forward[b] false) its end
// plus sync_time. Dependencies with their transfer delays, devices run one block at a time, a
// block's memory delta applies on its devices at its start and must stay within headroom[d]
// (< 0: unlimited), and instances of a block run in micro-batch order (no order rules: the
// caller asks Z3 where there are some). `after` holds pairs of instances [mb * K + block]
// (x, y): y starts after x ends (the orders a schedule keeps outside a window). Depth-first
// over semi-active schedules listed in order of (start, instance), pruned by release-time
// and per-device load bounds; stops after node_budget nodes (status unknown).
ExhaustiveResult schedule_within(const Graph& g, int n, int64_t target,
                                 const std::vector<int64_t>& headroom,
                                 const std::vector<char>& is_forward, int64_t sync_time,
                                 int64_t node_budget,
                                 const std::vector<std::pair<int, int>>& after = {});

}  // namespace pyplan
