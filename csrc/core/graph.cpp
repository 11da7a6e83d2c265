#include "core/graph.hpp"

#include <algorithm>
#include <functional>
#include <queue>
#include <stdexcept>

namespace pyplan {

Graph::Graph(int num_devices, std::vector<Block> blocks, std::vector<Edge> edges,
             std::vector<OrderRule> rules, std::vector<int64_t> static_memory,
             std::vector<int64_t> capacity)
    : num_devices_(num_devices), blocks_(std::move(blocks)), edges_(std::move(edges)),
      rules_(std::move(rules)), static_memory_(std::move(static_memory)),
      capacity_(std::move(capacity)) {
    if (num_devices_ <= 0 || num_devices_ > kMaxDevices)
        throw std::invalid_argument("num_devices must lie in 1 .. " + std::to_string(kMaxDevices));
    if (static_memory_.empty()) static_memory_.assign(num_devices_, 0);
    if (static_cast<int>(static_memory_.size()) != num_devices_)
        throw std::invalid_argument("static_memory needs one amount per device");
    for (int64_t s : static_memory_)
        if (s < 0 || s > kMaxMemory)
            throw std::invalid_argument("static memory must lie in 0 .. 2^60");
    if (capacity_.empty()) capacity_.assign(num_devices_, -1);
    if (static_cast<int>(capacity_.size()) != num_devices_)
        throw std::invalid_argument("capacity needs one amount per device");
    for (int64_t& c : capacity_) {
        if (c > kMaxMemory) throw std::invalid_argument("capacities must be at most 2^60");
        if (c < 0) c = -1;
    }
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

bool Graph::limited(int64_t capacity) const {
    for (int d = 0; d < num_devices_; ++d)
        if (limit(d, capacity) >= 0) return true;
    return false;
}

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

namespace {

__extension__ typedef __int128 Wide;  // (GCC and Clang; sums of memory x time)
constexpr int64_t kBoundCap = INT64_MAX / 4;  // bounds are clamped here (never reached in use)

int64_t clamp(Wide x) { return x > kBoundCap ? kBoundCap : static_cast<int64_t>(x); }

// ceil(n * num / den) for num >= 0, den > 0, without overflow for our ranges.
Wide ceil_times(int64_t n, Wide num, int64_t den) {
    Wide q = num / den, r = num % den;
    return Wide{n} * q + (Wide{n} * r + den - 1) / den;
}

// Least-cost flow of a transportation problem by successive shortest paths (Bellman-Ford on
// the residual graph): supplies to demands over the arcs with a cost; false if the demands
// cannot all be met. Small: one device's allocating and freeing blocks.
bool transport(const std::vector<int64_t>& supply, const std::vector<int64_t>& demand,
               const std::vector<std::vector<int64_t>>& cost,  // < INT64_MIN / 2: no arc
               Wide& total) {
    const int a = static_cast<int>(supply.size()), f = static_cast<int>(demand.size());
    const int nodes = a + f + 2, source = a + f, sink = a + f + 1;
    struct Arc {
        int to;
        int64_t cap;
        int64_t cost;
    };
    std::vector<Arc> arcs;
    std::vector<std::vector<int>> out(nodes);
    auto add = [&](int u, int v, int64_t cap, int64_t c) {
        out[u].push_back(static_cast<int>(arcs.size()));
        arcs.push_back({v, cap, c});
        out[v].push_back(static_cast<int>(arcs.size()));
        arcs.push_back({u, 0, -c});
    };
    int64_t need = 0;
    for (int i = 0; i < a; ++i) add(source, i, supply[i], 0);
    for (int j = 0; j < f; ++j) add(a + j, sink, demand[j], 0), need += demand[j];
    for (int i = 0; i < a; ++i)
        for (int j = 0; j < f; ++j)
            if (cost[i][j] > INT64_MIN / 2) add(i, a + j, INT64_MAX / 4, cost[i][j]);
    total = 0;
    int64_t sent = 0;
    constexpr int64_t kInf = INT64_MAX / 4;
    while (sent < need) {
        std::vector<int64_t> dist(nodes, kInf);
        std::vector<int> via(nodes, -1);
        dist[source] = 0;
        for (int pass = 0; pass < nodes; ++pass) {  // no negative cycles: costs come from a DAG
            bool changed = false;
            for (int u = 0; u < nodes; ++u) {
                if (dist[u] == kInf) continue;
                for (int id : out[u]) {
                    const Arc& arc = arcs[id];
                    if (arc.cap > 0 && dist[u] + arc.cost < dist[arc.to]) {
                        dist[arc.to] = dist[u] + arc.cost;
                        via[arc.to] = id;
                        changed = true;
                    }
                }
            }
            if (!changed) break;
        }
        if (dist[sink] == kInf) return false;
        int64_t push = need - sent;
        for (int v = sink; v != source; v = arcs[via[v] ^ 1].to) push = std::min(push, arcs[via[v]].cap);
        for (int v = sink; v != source; v = arcs[via[v] ^ 1].to) {
            arcs[via[v]].cap -= push;
            arcs[via[v] ^ 1].cap += push;
        }
        total += Wide{push} * dist[sink];
        sent += push;
    }
    return true;
}

// Longest path from the start of `from` to the start of every block (-1: none).
std::vector<int64_t> starts_after(const Graph& g, int from, const std::vector<int>& order) {
    std::vector<int64_t> dist(g.num_blocks(), -1);
    dist[from] = 0;
    for (int b : order) {
        if (dist[b] < 0) continue;
        for (size_t i = 0; i < g.successors(b).size(); ++i) {
            int s = g.successors(b)[i];
            dist[s] = std::max(dist[s], dist[b] + g.block(b).time + g.successor_delays(b)[i]);
        }
    }
    return dist;
}

constexpr size_t kTransportPairs = 4096;  // larger devices: no memory-time bound

Wide memory_time_of(const Graph& g, int d, const std::vector<int>& order) {
    std::vector<int> alloc, frees;
    std::vector<int64_t> supply, demand;
    Wide held = 0, freed = 0;
    for (int b : g.blocks_on(d)) {
        int64_t m = g.block(b).memory;
        if (m > 0) alloc.push_back(b), supply.push_back(m), held += m;
        if (m < 0) frees.push_back(b), demand.push_back(-m), freed -= m;
    }
    if (held == 0 || held != freed || held > kMaxMemory ||
        alloc.size() * frees.size() > kTransportPairs)
        return -1;
    std::vector<std::vector<int64_t>> cost(alloc.size(), std::vector<int64_t>(frees.size()));
    for (size_t i = 0; i < alloc.size(); ++i) {
        auto dist = starts_after(g, alloc[i], order);
        for (size_t j = 0; j < frees.size(); ++j)
            cost[i][j] = dist[frees[j]] < 0 ? INT64_MIN : -dist[frees[j]];  // max-cost
    }
    Wide total = 0;
    if (!transport(supply, demand, cost, total)) return -1;
    return -total;
}

// Largest (least head + n x load + least tail) over the subsets of blocks on d with heads and
// tails above thresholds: the instances of a subset run one after another on d.
int64_t subset_bound(const Graph& g, int d, int n, const std::vector<int64_t>& head,
                     const std::vector<int64_t>& tail) {
    const auto& on = g.blocks_on(d);
    if (on.size() > 512) return 0;  // the plain bound (all blocks) still applies
    std::vector<int> by_tail(on.begin(), on.end());
    std::sort(by_tail.begin(), by_tail.end(), [&](int x, int y) {
        return tail[x] != tail[y] ? tail[x] > tail[y] : x < y;
    });
    Wide best = 0;
    for (int floor_block : on) {
        const int64_t floor = head[floor_block];
        Wide load = 0;
        int64_t least_head = INT64_MAX;
        for (int b : by_tail) {
            if (head[b] < floor) continue;
            load += g.block(b).time;
            least_head = std::min(least_head, head[b]);
            best = std::max(best, Wide{least_head} + Wide{n} * load + tail[b]);
        }
    }
    return clamp(best);
}

}  // namespace

int64_t Graph::head_idle(int device) const {
    if (device < 0 || device >= num_devices_) throw std::out_of_range("no such device");
    std::vector<char> fed;
    return idle_before_fed(*this, device, pred_, pred_delay_, require_order(*this), fed);
}

int64_t Graph::memory_time(int device) const {
    if (device < 0 || device >= num_devices_) throw std::out_of_range("no such device");
    return clamp(memory_time_of(*this, device, require_order(*this)));
}

int64_t Graph::period_bound(int64_t capacity) const {
    int64_t bound = load_bound();
    auto order = require_order(*this);
    for (int d = 0; d < num_devices_; ++d) {
        int64_t room = limit(d, capacity);
        if (room < 0) continue;
        room -= static_memory_[d];
        Wide area = memory_time_of(*this, d, order);
        if (area <= 0 || room <= 0) continue;  // (nothing fits at all: checked elsewhere)
        bound = std::max(bound, clamp((area + room - 1) / room));
    }
    return bound;
}

int64_t Graph::makespan_bound(int num_micro_batches, int64_t capacity) const {
    if (num_micro_batches <= 0) return 0;
    const int k = num_blocks();
    const int n = num_micro_batches;
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
        bound = std::max(bound, min_head + n * load[d] + min_tail);
        bound = std::max(bound, subset_bound(*this, d, n, head, tail));
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
        bound = std::max(bound, n * load[d] + idle);
        int64_t room = limit(d, capacity);
        if (room < 0) continue;
        bound = std::max(bound, memory_bound(*this, d, n, room, order, head, tail));
        // Memory-time: n micro-batches hold n x area between the earliest allocation and the
        // latest free, within the room the weights leave.
        room -= static_memory_[d];
        Wide area = memory_time_of(*this, d, order);
        if (area <= 0 || room <= 0) continue;
        int64_t first = INT64_MAX, last = INT64_MAX;
        for (int b : on_device_[d]) {
            if (block(b).memory > 0) first = std::min(first, head[b]);
            if (block(b).memory < 0) last = std::min(last, block(b).time + tail[b]);
        }
        bound = std::max(bound, clamp(ceil_times(n, area, room) + first + last));
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
