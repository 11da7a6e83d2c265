// Tessel repetends: enumeration of micro-batch index assignments (Eq. 3, Properties 4.1/4.2),
// steady-state evaluation of a repeated per-device order (Eq. 4 with compaction), warmup and
// cooldown sets (Eq. 5-6) and extension to N micro-batches.
#pragma once

#include <chrono>
#include <cstdint>
#include <vector>

#include "core/evaluate.hpp"
#include "core/graph.hpp"

namespace pyplan {

// A repetend: block b of iteration j processes micro-batch j + indices[b]; every device runs its
// blocks of an iteration in `orders[d]`, and iteration j starts at j * period. Offsets are the
// start of each block relative to its iteration (they may exceed the period: compaction).
struct Repetend {
    std::vector<int> indices;              // Tessel's n_b, min 0
    std::vector<std::vector<int>> orders;  // per device, block ids
    bool feasible = false;                 // the order is consistent with the dependencies
    int64_t period = 0;                    // t_R: least integer steady-state period
    std::vector<int64_t> offsets;          // per block
    std::vector<int64_t> execution;        // E_R per device
    std::vector<int64_t> wait;             // W_R per device = period - E_R
    std::vector<int64_t> entry_memory;     // per device, blocks run before the repetend
    std::vector<int64_t> peak_memory;      // per device, steady state
    int num_micro_batches() const;         // N_R = 1 + max index
    double bubble_rate(const Graph& g) const;
};

// Streams the index assignments with max index num_mb - 1 and min 0, monotone along the
// dependencies (n_to <= n_from), pruned by shared-device order rules, by entry memory and, when
// period_below > 0, by the per-candidate period bound (candidates that cannot go below it).
class RepetendEnumerator {
  public:
    RepetendEnumerator(const Graph& graph, int num_mb, int64_t memory_capacity = -1,
                       int64_t period_below = 0);
    // Fills `out` with the next assignment; false when exhausted.
    bool next(std::vector<int>& out);
    int64_t visited_nodes() const { return visited_; }
    void set_period_below(int64_t p) { period_below_ = p; }
    // Stop (as if exhausted) once `seconds` of wall time have passed; <= 0: no limit.
    void set_time_limit(double seconds);
    // Stop once this many search nodes were visited; <= 0: no limit.
    void set_node_limit(int64_t nodes) { node_limit_ = nodes; }
    bool out_of_time() const { return out_of_time_; }

  private:
    bool feasible_prefix(int depth);
    const Graph& g_;
    int num_mb_;
    std::vector<int64_t> room_;  // per device: the capacity (< 0: unlimited)
    int64_t period_below_;
    int64_t load_bound_ = 0;
    std::vector<int> topo_, pos_;
    std::vector<int> value_;                 // current assignment by block
    std::vector<int> depth_;                 // DFS: next value to try at each depth
    int level_ = 0;
    bool started_ = false, done_ = false, out_of_time_ = false;
    bool timed_ = false;
    int64_t node_limit_ = 0;
    std::chrono::steady_clock::time_point deadline_{};
    int64_t visited_ = 0;
    std::vector<std::vector<int64_t>> longest_;  // longest start-to-start path, -1 if none
    std::vector<std::vector<std::pair<int, int64_t>>> checks_;  // by depth: (i, bound numer)
    std::vector<std::vector<int>> rule_checks_;                 // by depth: rule indices
    std::vector<int> device_done_depth_;       // depth at which each device's blocks are set
};

// Longest start-to-start dependency path between every pair of blocks (-1: no path).
std::vector<std::vector<int64_t>> longest_paths(const Graph& g);

// Per-candidate lower bound of the period for an index assignment.
int64_t repetend_bound(const Graph& g, const std::vector<int>& indices,
                       const std::vector<std::vector<int64_t>>& longest);

// Exact steady-state evaluation of a repeated order: least integer period without a positive
// cycle, offsets from the longest-path potentials, memory in steady state.
Repetend evaluate_repetend(const Graph& g, const std::vector<int>& indices,
                           const std::vector<std::vector<int>>& orders, int64_t min_period = 0);

// Fast heuristic order inside a repetend (critical-path list scheduling of one iteration),
// evaluated exactly.
Repetend list_schedule_repetend(const Graph& g, const std::vector<int>& indices);

bool memory_fits(const Repetend& r, int64_t capacity);
// The same with each device's own capacity too (Graph::limit).
bool memory_fits(const Graph& g, const Repetend& r, int64_t capacity);

// Eq. 5: {B_b^m : m < n_b}. Eq. 6 (relative to the last repetend): {B_b^m : n_b < m < N_R}.
std::vector<Instance> warmup_blocks(const std::vector<int>& indices);
std::vector<Instance> cooldown_blocks(const std::vector<int>& indices);

// Orders of the periodic schedule for n micro-batches: iterations -(N_R-1) .. n-1, each device
// running the repetend order, instances outside [0, n) dropped. Warmup and cooldown are the
// partial iterations at both ends.
DeviceOrders periodic_orders(const Graph& g, const Repetend& r, int num_micro_batches);

// Full orders from explicit warmup, repetend and cooldown: cooldown micro-batches are relative
// to the last repetend (index m means m + n - N_R).
DeviceOrders extend(const Graph& g, const DeviceOrders& warmup, const Repetend& r,
                    const DeviceOrders& cooldown, int num_micro_batches);

struct RepetendSearchStats {
    bool out_of_time = false;
    int64_t enumerated = 0;
    int64_t evaluated = 0;
    int64_t pruned_memory = 0;
    int64_t visited_nodes = 0;
};

// Enumerate every candidate with N_R = num_mb, evaluate the list-scheduled order of those whose
// bound can beat `best_period` (0: none yet) and keep the best feasible one within memory.
// Stops early when a candidate reaches `target`. Returns the best (feasible == false if none).
// `seconds` > 0 bounds the wall time (checked every few candidates).
Repetend search_repetends(const Graph& g, int num_mb, int64_t memory_capacity, int64_t best_period,
                          int64_t target, int64_t max_candidates, RepetendSearchStats& stats,
                          double seconds = 0);

// Makespan of the periodic schedule of a repetend for n micro-batches (-1 if it does not run).
int64_t periodic_makespan(const Graph& g, const Repetend& r, int num_micro_batches,
                          int64_t memory_capacity);

// Candidates with N_R = num_mb whose list-scheduled period is at most `period`, within memory,
// ranked by the makespan of their periodic schedule for n micro-batches (then N_R); the best
// `keep` of at most `max_candidates` enumerated.
std::vector<Repetend> rank_repetends(const Graph& g, int num_mb, int64_t memory_capacity,
                                     int64_t period, int num_micro_batches, int keep,
                                     int64_t max_candidates, RepetendSearchStats& stats,
                                     double seconds = 0);

}  // namespace pyplan
