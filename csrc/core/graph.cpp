#include "core/graph.hpp"

#include <algorithm>
#include <functional>
#include <queue>
#include <stdexcept>

namespace pyplan {

Graph::Graph(int num_devices, std::vector<Block> blocks, std::vector<Edge> edges,
             std::vector<OrderRule> rules, std::vector<int64_t> static_memory)
    : num_devices_(num_devices), blocks_(std::move(blocks)), edges_(std::move(edges)),
      rules_(std::move(rules)), static_memory_(std::move(static_memory)) {
    if (num_devices_ <= 0 || num_devices_ > kMaxDevices)
        throw std::invalid_argument("num_devices must lie in 1 .. " + std::to_string(kMaxDevices));
    if (static_memory_.empty()) static_memory_.assign(num_devices_, 0);
    if (static_cast<int>(static_memory_.size()) != num_devices_)
        throw std::invalid_argument("static_memory needs one amount per device");
    for (int64_t s : static_memory_)
        if (s < 0 || s > kMaxMemory)
            throw std::invalid_argument("static memory must lie in 0 .. 2^60");
    const int k = num_blocks();
    // Every search and bound assumes at least one block (a plan always has one).
    if (k == 0) throw std::invalid_argument("a graph needs at least one block");
    on_device_.assign(num_devices_, {});
    for (int b = 0; b < k; ++b) {
        Block& blk = blocks_[b];
        if (blk.time <= 0 || blk.time > kMaxTime)
            throw std::invalid_argument("block '" + blk.name + "' has time outside 1 .. 2^40");
        if (blk.memory > kMaxMemory || blk.memory < -kMaxMemory)
            throw std::invalid_argument("block '" + blk.name + "' has memory beyond +-2^60");
        if (blk.devices.empty())
            throw std::invalid_argument("block '" + blk.name + "' has no devices");
        std::sort(blk.devices.begin(), blk.devices.end());
        if (std::adjacent_find(blk.devices.begin(), blk.devices.end()) != blk.devices.end())
            throw std::invalid_argument("block '" + blk.name + "' lists a device twice");
        for (int d : blk.devices) {
            if (d < 0 || d >= num_devices_)
                throw std::out_of_range("block '" + blk.name + "' uses device " +
                                        std::to_string(d) + " of " +
                                        std::to_string(num_devices_));
            on_device_[d].push_back(b);
        }
    }
    succ_.assign(k, {});
    pred_.assign(k, {});
    succ_delay_.assign(k, {});
    pred_delay_.assign(k, {});
    for (const Edge& e : edges_) {
        if (e.from < 0 || e.from >= k || e.to < 0 || e.to >= k)
            throw std::out_of_range("dependency refers to a block index out of range");
        if (e.from == e.to)
            throw std::invalid_argument("block '" + blocks_[e.from].name + "' depends on itself");
        if (e.delay < 0 || e.delay > kMaxTime)
            throw std::invalid_argument("a dependency's transfer time must lie in 0 .. 2^40");
        succ_[e.from].push_back(e.to);
        pred_[e.to].push_back(e.from);
        succ_delay_[e.from].push_back(e.delay);
        pred_delay_[e.to].push_back(e.delay);
        has_delays_ = has_delays_ || e.delay > 0;
    }
    for (const OrderRule& r : rules_) {
        if (r.before < 0 || r.before >= k || r.after < 0 || r.after >= k)
            throw std::out_of_range("order rule refers to a block index out of range");
        for (int v : {r.before_shift, r.after_shift, r.min_m})
            if (v > kMaxShift || v < -kMaxShift)
                throw std::invalid_argument("order rule shifts and min_m must lie within +-10^7");
    }
    shares_.assign(k, std::vector<char>(k, 0));
    for (int d = 0; d < num_devices_; ++d)
        for (int a : on_device_[d])
            for (int b : on_device_[d]) shares_[a][b] = 1;
}

bool Graph::shares_device(int a, int b) const { return shares_[a][b] != 0; }

std::vector<int> Graph::topological_order() const {
    const int k = num_blocks();
    std::vector<int> indegree(k, 0);
    for (const Edge& e : edges_) ++indegree[e.to];
    std::priority_queue<int, std::vector<int>, std::greater<int>> ready;
    for (int b = 0; b < k; ++b)
        if (indegree[b] == 0) ready.push(b);
    std::vector<int> order;
    order.reserve(k);
    while (!ready.empty()) {
        int b = ready.top();
        ready.pop();
        order.push_back(b);
        for (int s : succ_[b])
            if (--indegree[s] == 0) ready.push(s);
    }
    if (static_cast<int>(order.size()) != k) order.clear();
    return order;
}

std::vector<int> Graph::find_cycle() const {
    // Iterative DFS with colours; a grey successor closes a cycle.
    const int k = num_blocks();
    std::vector<char> colour(k, 0);  // 0 white, 1 grey, 2 black
    std::vector<int> parent(k, -1);
    for (int root = 0; root < k; ++root) {
        if (colour[root] != 0) continue;
        std::vector<std::pair<int, size_t>> stack{{root, 0}};
        colour[root] = 1;
        while (!stack.empty()) {
            auto& [b, next] = stack.back();
            if (next < succ_[b].size()) {
                int s = succ_[b][next++];
                if (colour[s] == 0) {
                    colour[s] = 1;
                    parent[s] = b;
                    stack.push_back({s, 0});
                } else if (colour[s] == 1) {
                    std::vector<int> cycle{s};
                    for (int x = b; x != s; x = parent[x]) cycle.push_back(x);
                    std::reverse(cycle.begin() + 1, cycle.end());
                    return cycle;
                }
            } else {
                colour[b] = 2;
                stack.pop_back();
            }
        }
    }
    return {};
}

std::vector<int64_t> Graph::device_loads() const {
    std::vector<int64_t> load(num_devices_, 0);
    for (const Block& blk : blocks_)
        for (int d : blk.devices) load[d] += blk.time;
    return load;
}

int64_t Graph::load_bound() const {
    auto load = device_loads();
    return *std::max_element(load.begin(), load.end());
}

static std::vector<int> require_order(const Graph& g) {
    auto order = g.topological_order();
    if (static_cast<int>(order.size()) != g.num_blocks())
        throw std::invalid_argument("the dependency graph has a cycle");
    return order;
}

std::vector<int64_t> Graph::heads() const {
    auto order = require_order(*this);
    std::vector<int64_t> head(num_blocks(), 0);
    for (int b : order)
        for (size_t i = 0; i < succ_[b].size(); ++i)
            head[succ_[b][i]] = std::max(head[succ_[b][i]],
                                         head[b] + blocks_[b].time + succ_delay_[b][i]);
    return head;
}

std::vector<int64_t> Graph::tails() const {
    auto order = require_order(*this);
    std::vector<int64_t> tail(num_blocks(), 0);
    for (auto it = order.rbegin(); it != order.rend(); ++it)
        for (size_t i = 0; i < succ_[*it].size(); ++i) {
            int s = succ_[*it][i];
            tail[*it] = std::max(tail[*it], succ_delay_[*it][i] + blocks_[s].time + tail[s]);
        }
    return tail;
}

int64_t Graph::critical_path() const {
    auto head = heads();
    int64_t best = 0;
    for (int b = 0; b < num_blocks(); ++b) best = std::max(best, head[b] + blocks_[b].time);
    return best;
}

// Least idle time of device d before it first runs a block fed from another device (a "fed"
// block), over `pred`/`order` (the reversed graph gives the idle time after it last feeds
// another device). Until its first fed instance, d can only run blocks whose ancestors are all
// on d; while a chain of other devices' blocks that each conflict with all of those runs, d
// can do nothing; transfers count only when d has no such blocks at all. Marks the fed blocks in
// `fed`.
static int64_t idle_before_fed(const Graph& g, int d, const std::vector<std::vector<int>>& pred,
                               const std::vector<std::vector<int64_t>>& delay,
                               const std::vector<int>& order, std::vector<char>& fed) {
    const int k = g.num_blocks();
    std::vector<char> on(k, 0), closed(k, 0), after_fed(k, 0);
    for (int b : g.blocks_on(d)) on[b] = 1;
    fed.assign(k, 0);
    std::vector<int> free;
    for (int b : order) {
        if (on[b]) {
            closed[b] = 1;
            for (int p : pred[b]) {
                closed[b] &= closed[p];
                if (!on[p]) fed[b] = 1;
            }
            if (closed[b]) free.push_back(b);
        }
        for (int p : pred[b])
            if (fed[p] || after_fed[p]) after_fed[b] = 1;
    }
    const bool idle_in_transfers = free.empty();
    auto arrival = [&](const std::vector<int64_t>& chain, int b) {
        int64_t before = 0;
        for (size_t i = 0; i < pred[b].size(); ++i)
            if (!on[pred[b][i]])
                before = std::max(before, chain[pred[b][i]] +
                                              (idle_in_transfers ? delay[b][i] : 0));
        return before;
    };
    std::vector<int64_t> chain(k, 0);
    for (int b : order) {
        if (on[b]) continue;
        bool waits = true;
        for (int e : free) waits = waits && g.shares_device(b, e);
        chain[b] = (waits ? g.block(b).time : 0) + arrival(chain, b);
    }
    int64_t idle = INT64_MAX;
    for (int b = 0; b < k; ++b) {
        if (!fed[b] || after_fed[b]) continue;
        idle = std::min(idle, arrival(chain, b));
    }
    return idle == INT64_MAX ? 0 : idle;
}

// What memory forces on device d: when every block on d that frees memory depends on every block
// on d that allocates (a stage's backward on its forwards), a micro-batch holds all it allocates,
// X, from its last allocation until its first free, at least L (the shortest longest path
// between the two); at most capacity / X micro-batches do so at once, so N * L time must fit in
// that many lanes of the window between the earliest allocation and the latest free.
static int64_t memory_bound(const Graph& g, int d, int n, int64_t capacity,
                            const std::vector<int>& order, const std::vector<int64_t>& head,
                            const std::vector<int64_t>& tail) {
    std::vector<int> alloc, frees;
    int64_t held = 0;
    for (int b : g.blocks_on(d)) {
        if (g.block(b).memory > 0) alloc.push_back(b), held += g.block(b).memory;
        if (g.block(b).memory < 0) frees.push_back(b);
    }
    capacity -= g.static_memory(d);  // what the weights leave for activations
    if (held <= 0 || frees.empty() || capacity < held) return 0;
    const int k = g.num_blocks();
    int64_t shortest = INT64_MAX, first = INT64_MAX, last = INT64_MAX;
    for (int a : alloc) {
        std::vector<int64_t> dist(k, -1);  // longest path from a's start to each block's start
        dist[a] = 0;
        for (int b : order) {
            if (dist[b] < 0) continue;
            for (size_t i = 0; i < g.successors(b).size(); ++i) {
                int s = g.successors(b)[i];
                dist[s] = std::max(dist[s], dist[b] + g.block(b).time + g.successor_delays(b)[i]);
            }
        }
        for (int f : frees) {
            if (dist[f] < 0) return 0;  // a free that need not wait for this allocation
            shortest = std::min(shortest, dist[f]);
        }
        first = std::min(first, head[a]);
    }
    for (int f : frees) last = std::min(last, g.block(f).time + tail[f]);
    int64_t lanes = capacity / held;
    return (n * shortest + lanes - 1) / lanes + first + last;
}

int64_t Graph::makespan_bound(int num_micro_batches, int64_t capacity) const {
    if (num_micro_batches <= 0) return 0;
    const int k = num_blocks();
    auto head = heads();
    auto tail = tails();
    auto load = device_loads();
    auto order = require_order(*this);
    std::vector<int> reversed(order.rbegin(), order.rend());
    int64_t bound = critical_path();
    std::vector<char> fed, feeds, reach(k);
    for (int d = 0; d < num_devices_; ++d) {
        if (on_device_[d].empty()) continue;
        int64_t min_head = INT64_MAX, min_tail = INT64_MAX;
        for (int b : on_device_[d]) {
            min_head = std::min(min_head, head[b]);
            min_tail = std::min(min_tail, tail[b]);
        }
        bound = std::max(bound, min_head + num_micro_batches * load[d] + min_tail);
        int64_t idle_head = idle_before_fed(*this, d, pred_, pred_delay_, order, fed);
        int64_t idle_tail = idle_before_fed(*this, d, succ_, succ_delay_, reversed, feeds);
        // Both idle stretches count when some fed block precedes (or is) a feeding one: then the
        // first fed instance starts before the last feeding one ends.
        bool disjoint = false;
        for (int b : reversed) {
            reach[b] = feeds[b];
            for (int s : succ_[b]) reach[b] |= reach[s];
            disjoint = disjoint || (fed[b] && reach[b]);
        }
        int64_t idle = disjoint ? idle_head + idle_tail : std::max(idle_head, idle_tail);
        bound = std::max(bound, num_micro_batches * load[d] + idle);
        if (capacity >= 0)
            bound = std::max(bound, memory_bound(*this, d, num_micro_batches, capacity, order,
                                                 head, tail));
    }
    return bound;
}

std::vector<int64_t> Graph::net_memory() const {
    std::vector<int64_t> net(num_devices_, 0);
    for (const Block& blk : blocks_)
        for (int d : blk.devices) net[d] += blk.memory;
    return net;
}

}  // namespace pyplan
