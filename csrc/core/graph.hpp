// Blocks of one micro-batch and their dependency DAG: the problem every other part of the core
// works on. Pure C++17, no pybind11.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace pyplan {

// What the core accepts: sums of times over all instances and devices stay far inside int64.
constexpr int kMaxDevices = 1 << 16;
constexpr int64_t kMaxTime = int64_t{1} << 40;
constexpr int64_t kMaxMemory = int64_t{1} << 60;
constexpr int kMaxMicroBatches = 10'000'000;  // micro-batch indices and counts
constexpr int kMaxShift = 10'000'000;         // order rule shifts and min_m
constexpr int kMaxRepetendMicroBatches = 4096;  // micro-batches one repetend may span

struct Block {
    std::string name;
    int64_t time = 1;          // execution time, > 0
    int64_t memory = 0;        // memory delta applied to each of its devices when it starts
    std::vector<int> devices;  // sorted, unique; all of them are occupied at once
};

// A dependency; `delay` is the time its data takes to reach `to` when the two run on different
// devices (a transfer on a link: neither device is busy meanwhile).
struct Edge {
    int from = 0;
    int to = 0;
    int64_t delay = 0;
};

// "before@(m + before_shift) finishes before after@(m + after_shift) starts" for every
// micro-batch m >= min_m for which both indices exist (nnScaler op-order).
struct OrderRule {
    int before = 0;
    int before_shift = 0;
    int after = 0;
    int after_shift = 0;
    int min_m = 0;
};

class Graph {
  public:
    // static_memory: bytes (or plan units) resident on each device for the whole run (weights,
    // gradients, optimizer state); empty means none. Every capacity check counts it.
    // capacity: each device's memory capacity (< 0: unlimited; empty: none given), for devices
    // with different memory; every check also takes a capacity for all devices, and the
    // smaller of the two applies (see limit).
    Graph(int num_devices, std::vector<Block> blocks, std::vector<Edge> edges,
          std::vector<OrderRule> rules = {}, std::vector<int64_t> static_memory = {},
          std::vector<int64_t> capacity = {});

    int num_devices() const { return num_devices_; }
    int num_blocks() const { return static_cast<int>(blocks_.size()); }
    const Block& block(int b) const { return blocks_[b]; }
    const std::vector<Block>& blocks() const { return blocks_; }
    const std::vector<Edge>& edges() const { return edges_; }
    const std::vector<OrderRule>& rules() const { return rules_; }
    const std::vector<int>& successors(int b) const { return succ_[b]; }
    const std::vector<int>& predecessors(int b) const { return pred_[b]; }
    // Edge delays aligned with successors(b) / predecessors(b).
    const std::vector<int64_t>& successor_delays(int b) const { return succ_delay_[b]; }
    const std::vector<int64_t>& predecessor_delays(int b) const { return pred_delay_[b]; }
    bool has_delays() const { return has_delays_; }
    const std::vector<int>& blocks_on(int device) const { return on_device_[device]; }
    bool shares_device(int a, int b) const;
    int64_t static_memory(int device) const { return static_memory_[device]; }
    const std::vector<int64_t>& static_memory() const { return static_memory_; }
    const std::vector<int64_t>& capacity() const { return capacity_; }
    // The capacity of a device under a capacity for all devices (< 0: none): the smaller of
    // that and the device's own; < 0 when neither limits it.
    int64_t limit(int device, int64_t capacity) const {
        int64_t own = capacity_[device];
        if (capacity < 0) return own;
        return own < 0 ? capacity : std::min(own, capacity);
    }
    // Whether any device is limited under that capacity.
    bool limited(int64_t capacity) const;

    // Kahn's algorithm, smallest index first among ready blocks; empty if there is a cycle.
    std::vector<int> topological_order() const;
    // One dependency cycle as a block list (first block not repeated); empty if acyclic.
    std::vector<int> find_cycle() const;
    bool is_acyclic() const { return find_cycle().empty(); }

    // Sum of block times per device for one micro-batch.
    std::vector<int64_t> device_loads() const;
    // Lower bound of a repetend period: the busiest device's load.
    int64_t load_bound() const;
    // Longest dependency path of one micro-batch, transfers included (its latency with
    // unlimited devices).
    int64_t critical_path() const;
    // Earliest start of each block with unlimited devices (longest path from the sources).
    std::vector<int64_t> heads() const;
    // Longest path from the end of each block to the end of the micro-batch.
    std::vector<int64_t> tails() const;
    // Makespan lower bound for n micro-batches: the critical path, and per device its load
    // plus the idle time it cannot avoid before it is first fed by another device and after
    // it last feeds one (exact for V- and M-shapes with enough memory: 4N+12, 6N+12), the same
    // for every subset of its blocks (least head + n x their load + least tail), and under a
    // memory limit what it forces on how many micro-batches are in flight: at most
    // capacity / X of them can hold a micro-batch's X at once, and n times a micro-batch's
    // memory-time (memory_time) must fit in capacity x the time memory can be held.
    int64_t makespan_bound(int num_micro_batches, int64_t capacity = -1) const;
    // Lower bound of a repetend period: the busiest device's load and, under a memory limit,
    // memory-time / capacity on every device (in steady state one micro-batch enters each
    // period, so a device holds memory-time / period on average: micro-batches in flight x
    // their lifetime <= capacity).
    int64_t period_bound(int64_t capacity = -1) const;
    // The least memory x time one micro-batch holds on a device over any schedule that keeps
    // the dependencies (its blocks' deltas apply at their starts): a max-cost transportation
    // of each allocation to the frees that depend on it along their longest paths (the dual of
    // min sum(-memory_b x start_b)). -1 when it is no bound: the device frees what none of its
    // allocations precede, or keeps memory at the end.
    int64_t memory_time(int device) const;
    // Idle time a device cannot avoid before it first runs a block fed by another device (the
    // part of makespan_bound before the device's last block ends: with n micro-batches that
    // block ends at n x load + this, or later).
    int64_t head_idle(int device) const;
    // Net memory a micro-batch leaves on each device after all its blocks ran.
    std::vector<int64_t> net_memory() const;

  private:
    int num_devices_;
    std::vector<Block> blocks_;
    std::vector<Edge> edges_;
    std::vector<OrderRule> rules_;
    std::vector<int64_t> static_memory_;
    std::vector<int64_t> capacity_;
    std::vector<std::vector<int>> succ_, pred_, on_device_;
    std::vector<std::vector<int64_t>> succ_delay_, pred_delay_;
    bool has_delays_ = false;
    std::vector<std::vector<char>> shares_;  // block x block: share a device
};

}  // namespace pyplan
