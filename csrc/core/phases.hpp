// Heuristic warmup and cooldown: list scheduling of a phase against the rest of a schedule.
#pragma once

#include <cstdint>
#include <vector>

#include "core/evaluate.hpp"
#include "core/graph.hpp"

namespace pyplan {

// Non-delay list scheduling of `phase` (instances of a schedule of num_micro_batches) while
// the rest of the schedule stays where `start` ([mb * K + block]) puts it and device d is free
// from `free[d]` on. Dependencies (with their transfer times) and the order rules bind the
// phase to the rest and within itself. The instance that can start earliest runs next; ties
// go to the longer path still ahead of it (tails), then the smaller micro-batch and block.
// reverse: time runs backward (a warmup scheduled from where the rest begins): an instance
// must end before its successors start, `free[d]` is minus the time from which the device is
// busy, and heads replace tails. Returns per-device orders of the scheduled instances in
// forward time; instances an order rule cycle blocks are left out.
DeviceOrders list_schedule_phase(const Graph& g, const std::vector<Instance>& phase,
                                 const std::vector<int64_t>& start,
                                 std::vector<int64_t> free, int num_micro_batches, bool reverse);

}  // namespace pyplan
