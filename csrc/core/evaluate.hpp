// Earliest-start evaluation of a schedule given as per-device orders of (block, micro-batch).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/graph.hpp"

namespace pyplan {

struct Instance {
    int block = 0;
    int mb = 0;
};

using DeviceOrders = std::vector<std::vector<Instance>>;

struct EvalOptions {
    int64_t memory_capacity = -1;         // < 0: unlimited
    std::vector<int64_t> initial_memory;  // per device, empty means zeros
    int complete_micro_batches = 0;       // > 0: every (block, m < this) must be scheduled
    bool enforce_rules = true;            // treat the graph's order rules as dependencies
};

struct Evaluation {
    bool ok = false;
    std::string reason;             // why the orders cannot complete, when !ok
    int num_micro_batches = 0;      // 1 + largest micro-batch index seen
    std::vector<int64_t> start;     // [mb * K + block], -1 when not scheduled
    int64_t makespan = 0;
    std::vector<int64_t> busy;      // per device
    std::vector<int64_t> peak_memory;
    std::vector<int64_t> final_memory;
    double bubble_rate = 0.0;       // idle device-time / (devices x makespan)
    int64_t scheduled_blocks = 0;   // instance count
    // On a deadlock, in cycle order: (holder, waiter) where the holder is ahead of the waiter on
    // a device the waiter needs (where an order breaks, so where an error should point).
    std::vector<std::pair<Instance, Instance>> deadlock_holds;
};

// Throws std::invalid_argument / std::out_of_range when the orders are malformed (unknown block,
// negative micro-batch, an instance on a device it is not placed on, missing or duplicated).
// A well-formed schedule that cannot run (deadlock, memory) returns ok == false with a reason.
Evaluation evaluate(const Graph& graph, const DeviceOrders& orders, const EvalOptions& options);

std::string instance_name(const Graph& graph, Instance inst);

}  // namespace pyplan
