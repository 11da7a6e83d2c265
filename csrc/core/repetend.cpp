#include "core/repetend.hpp"

#include <algorithm>
#include <chrono>
#include <numeric>
#include <stdexcept>

namespace pyplan {

int Repetend::num_micro_batches() const {
    return indices.empty() ? 0 : 1 + *std::max_element(indices.begin(), indices.end());
}

double Repetend::bubble_rate(const Graph& g) const {
    if (!feasible || period <= 0) return 1.0;
    int64_t load = 0;
    for (int64_t l : g.device_loads()) load += l;
    return 1.0 - static_cast<double>(load) / (static_cast<double>(g.num_devices()) * period);
}

std::vector<std::vector<int64_t>> longest_paths(const Graph& g) {
    const int k = g.num_blocks();
    auto order = g.topological_order();
    if (static_cast<int>(order.size()) != k)
        throw std::invalid_argument("the dependency graph has a cycle");
    std::vector<std::vector<int64_t>> dist(k, std::vector<int64_t>(k, -1));
    for (int src = 0; src < k; ++src) {
        auto& d = dist[src];
        d[src] = 0;
        for (int b : order) {
            if (d[b] < 0) continue;
            for (size_t i = 0; i < g.successors(b).size(); ++i) {
                int s = g.successors(b)[i];
                d[s] = std::max(d[s], d[b] + g.block(b).time + g.successor_delays(b)[i]);
            }
        }
    }
    return dist;
}

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

int64_t repetend_bound(const Graph& g, const std::vector<int>& n,
                       const std::vector<std::vector<int64_t>>& longest) {
    if (static_cast<int>(n.size()) != g.num_blocks())
        throw std::invalid_argument("need one micro-batch index per block");
    // On a device running i and later j of the same micro-batch (path i ~> j of length L), the
    // next instance of i on that device comes n_i - n_j + 1 periods after i and after j ends.
    int64_t bound = g.load_bound();
    const int k = g.num_blocks();
    for (int i = 0; i < k; ++i)
        for (int j = 0; j < k; ++j)
            if (i != j && longest[i][j] >= 0 && g.shares_device(i, j))
                bound = std::max(bound, ceil_div(longest[i][j] + g.block(j).time,
                                                 n[i] - n[j] + 1));
    return bound;
}

// ---------------------------------------------------------------- enumeration


RepetendEnumerator::RepetendEnumerator(const Graph& graph, int num_mb, int64_t capacity,
                                       int64_t period_below)
    : g_(graph), num_mb_(num_mb), period_below_(period_below) {
    if (num_mb < 1) throw std::invalid_argument("a repetend needs at least one micro-batch");
    for (int d = 0; d < g_.num_devices(); ++d) room_.push_back(g_.limit(d, capacity));
    const int k = g_.num_blocks();
    topo_ = g_.topological_order();
    if (static_cast<int>(topo_.size()) != k)
        throw std::invalid_argument("the dependency graph has a cycle");
    pos_.assign(k, 0);
    for (int i = 0; i < k; ++i) pos_[topo_[i]] = i;
    value_.assign(k, 0);
    depth_.assign(k + 1, 0);
    longest_ = longest_paths(g_);
    load_bound_ = g_.load_bound();
    checks_.assign(k, {});
    for (int i = 0; i < k; ++i)
        for (int j = 0; j < k; ++j)
            if (i != j && longest_[i][j] >= 0 && g_.shares_device(i, j))
                checks_[pos_[j]].push_back({i, longest_[i][j] + g_.block(j).time});
    // Rule A[m+a] < B[m+b] in steady state: A's iteration (m+a-n_A) may not come after B's.
    rule_checks_.assign(k, {});
    for (size_t i = 0; i < g_.rules().size(); ++i) {
        const OrderRule& r = g_.rules()[i];
        rule_checks_[std::max(pos_[r.before], pos_[r.after])].push_back(static_cast<int>(i));
    }
    device_done_depth_.assign(g_.num_devices(), -1);
    for (int d = 0; d < g_.num_devices(); ++d)
        for (int b : g_.blocks_on(d)) device_done_depth_[d] = std::max(device_done_depth_[d], pos_[b]);
}

void RepetendEnumerator::set_time_limit(double seconds) {
    timed_ = seconds > 0;
    deadline_ = std::chrono::steady_clock::now() +
                std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                    std::chrono::duration<double>(timed_ ? seconds : 0));
}

bool RepetendEnumerator::feasible_prefix(int depth) {
    const int j = topo_[depth];
    if (period_below_ > 0)
        for (auto [i, numer] : checks_[depth])
            if (ceil_div(numer, value_[i] - value_[j] + 1) >= period_below_) return false;
    for (int i : rule_checks_[depth]) {
        const OrderRule& r = g_.rules()[i];
        if (value_[r.after] - value_[r.before] > r.after_shift - r.before_shift) return false;
    }
    for (int d = 0; d < g_.num_devices(); ++d)
        if (room_[d] >= 0 && device_done_depth_[d] == depth) {
            int64_t entry = 0;
            for (int b : g_.blocks_on(d)) entry += g_.block(b).memory * value_[b];
            if (entry + g_.static_memory(d) > room_[d]) return false;
        }
    return true;
}

bool RepetendEnumerator::next(std::vector<int>& out) {
    const int k = g_.num_blocks();
    if (done_) return false;
    if (period_below_ > 0 && load_bound_ >= period_below_) {  // no candidate can beat it
        done_ = true;
        return false;
    }
    // depth_[l] holds the next value to try at level l (counting down); -1 means exhausted.
    auto upper = [&](int level) {
        int b = topo_[level];
        int hi = num_mb_ - 1;
        for (int p : g_.predecessors(b)) hi = std::min(hi, value_[p]);
        return hi;
    };
    if (!started_) {
        started_ = true;
        level_ = 0;
        depth_[0] = upper(0);
    } else {
        level_ = k - 1;  // resume below the last leaf
    }
    while (level_ >= 0) {
        if (depth_[level_] < 0) {
            --level_;
            continue;
        }
        value_[topo_[level_]] = depth_[level_]--;
        ++visited_;
        if (node_limit_ > 0 && visited_ >= node_limit_) {
            done_ = true;
            return false;
        }
        if ((visited_ & 1023) == 0 && timed_ && std::chrono::steady_clock::now() >= deadline_) {
            out_of_time_ = done_ = true;
            return false;
        }
        if (!feasible_prefix(level_)) continue;
        if (level_ + 1 < k) {
            ++level_;
            depth_[level_] = upper(level_);
            continue;
        }
        int lo = *std::min_element(value_.begin(), value_.end());
        int hi = *std::max_element(value_.begin(), value_.end());
        if (lo == 0 && hi == num_mb_ - 1) {
            out = value_;
            return true;
        }
    }
    done_ = true;
    return false;
}

// ---------------------------------------------------------------- steady-state evaluation

namespace {

struct CycEdge {
    int from, to;
    int64_t weight;
    int64_t distance;
};

// Longest-path potentials for constraints a_to - a_from >= weight - distance * period; false on a
// positive cycle.
bool potentials(int k, const std::vector<CycEdge>& edges, int64_t period,
                std::vector<int64_t>& dist) {
    dist.assign(k, 0);
    for (int pass = 0; pass <= k; ++pass) {
        bool changed = false;
        for (const CycEdge& e : edges) {
            int64_t cand = dist[e.from] + e.weight - e.distance * period;
            if (cand > dist[e.to]) {
                dist[e.to] = cand;
                changed = true;
            }
        }
        if (!changed) return true;
    }
    return false;
}

}  // namespace

Repetend evaluate_repetend(const Graph& g, const std::vector<int>& n,
                           const std::vector<std::vector<int>>& orders, int64_t min_period) {
    const int k = g.num_blocks();
    const int D = g.num_devices();
    if (static_cast<int>(n.size()) != k)
        throw std::invalid_argument("need one micro-batch index per block");
    for (int v : n)
        if (v < 0) throw std::invalid_argument("micro-batch indices must be non-negative");
    if (static_cast<int>(orders.size()) != D)
        throw std::invalid_argument("need one order per device");
    Repetend r;
    r.indices = n;
    r.orders = orders;
    std::vector<CycEdge> edges;
    for (const Edge& e : g.edges()) {
        if (n[e.to] > n[e.from])
            throw std::invalid_argument("indices must not increase along a dependency (" +
                                        g.block(e.from).name + " -> " + g.block(e.to).name + ")");
        edges.push_back({e.from, e.to, g.block(e.from).time + e.delay, n[e.from] - n[e.to]});
    }
    for (const OrderRule& rule : g.rules()) {
        int64_t h = (rule.after_shift - rule.before_shift) - n[rule.after] + n[rule.before];
        if (h < 0) return r;  // the rule would point back across iterations
        edges.push_back({rule.before, rule.after, g.block(rule.before).time, h});
    }
    for (int d = 0; d < D; ++d) {
        std::vector<int> sorted = orders[d], expect = g.blocks_on(d);
        std::sort(sorted.begin(), sorted.end());
        if (sorted != expect)
            throw std::invalid_argument("the order of device " + std::to_string(d) +
                                        " must list exactly its blocks once");
        const auto& ord = orders[d];
        for (size_t i = 0; i + 1 < ord.size(); ++i)
            edges.push_back({ord[i], ord[i + 1], g.block(ord[i]).time, 0});
        if (!ord.empty()) edges.push_back({ord.back(), ord.front(), g.block(ord.back()).time, 1});
    }
    int64_t total = 0;  // one block after another, every transfer between: always feasible
    for (const Block& b : g.blocks()) total += b.time;
    for (const Edge& e : g.edges()) total += e.delay;
    int64_t lo = std::max<int64_t>({min_period, g.load_bound(), 1});
    int64_t hi = std::max(lo, total);
    std::vector<int64_t> dist;
    if (!potentials(k, edges, hi, dist)) return r;  // a cycle within one iteration
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (potentials(k, edges, mid, dist)) hi = mid;
        else lo = mid + 1;
    }
    potentials(k, edges, lo, dist);
    int64_t base = *std::min_element(dist.begin(), dist.end());
    r.feasible = true;
    r.period = lo;
    r.offsets.resize(k);
    for (int b = 0; b < k; ++b) r.offsets[b] = dist[b] - base;
    r.execution.assign(D, 0);
    r.wait.assign(D, 0);
    r.entry_memory.assign(D, 0);
    r.peak_memory.assign(D, 0);
    for (int d = 0; d < D; ++d) {
        const auto& ord = orders[d];
        r.peak_memory[d] = g.static_memory(d);  // peaks count what is resident all along
        if (ord.empty()) {
            r.wait[d] = r.period;
            continue;
        }
        int64_t first = INT64_MAX, last = INT64_MIN, entry = 0;
        for (int b : ord) {
            first = std::min(first, r.offsets[b]);
            last = std::max(last, r.offsets[b] + g.block(b).time);
            entry += g.block(b).memory * n[b];
        }
        r.execution[d] = last - first;
        r.wait[d] = r.period - r.execution[d];
        r.entry_memory[d] = entry;
        int64_t mem = entry, peak = entry;
        for (int b : ord) peak = std::max(peak, mem += g.block(b).memory);
        r.peak_memory[d] += peak;
    }
    return r;
}

bool memory_fits(const Repetend& r, int64_t capacity) {
    if (capacity < 0) return true;
    for (int64_t p : r.peak_memory)
        if (p > capacity) return false;
    return true;
}

bool memory_fits(const Graph& g, const Repetend& r, int64_t capacity) {
    for (size_t d = 0; d < r.peak_memory.size() && d < static_cast<size_t>(g.num_devices()); ++d) {
        int64_t room = g.limit(static_cast<int>(d), capacity);
        if (room >= 0 && r.peak_memory[d] > room) return false;
    }
    return true;
}

// ---------------------------------------------------------------- list scheduling

namespace {

// One iteration, list-scheduled by height among same-iteration dependencies; `release` holds
// when cross-iteration inputs arrive (relative to the iteration start).
std::vector<std::vector<int>> list_order(const Graph& g, const std::vector<int>& n,
                                         const std::vector<int64_t>& release) {
    const int k = g.num_blocks();
    std::vector<std::vector<std::pair<int, int64_t>>> succ(k);  // (successor, transfer time)
    std::vector<int> waiting(k, 0);
    for (const Edge& e : g.edges())
        if (n[e.from] == n[e.to]) {
            succ[e.from].push_back({e.to, e.delay});
            ++waiting[e.to];
        }
    for (const OrderRule& r : g.rules())
        if ((r.after_shift - r.before_shift) - n[r.after] + n[r.before] == 0 && r.before != r.after) {
            succ[r.before].push_back({r.after, 0});
            ++waiting[r.after];
        }
    // Heights over same-iteration edges (a DAG: subset of the dependency DAG plus rules; rules
    // could close a cycle, in which case heights stay partial and the evaluation rejects it).
    std::vector<int64_t> height(k, 0);
    auto topo = g.topological_order();
    for (auto it = topo.rbegin(); it != topo.rend(); ++it) {
        int b = *it;
        height[b] = g.block(b).time;
        for (auto [s, delay] : succ[b])
            height[b] = std::max(height[b], g.block(b).time + delay + height[s]);
    }
    std::vector<int64_t> ready(release), device_free(g.num_devices(), 0);
    std::vector<char> done(k, 0);
    std::vector<std::vector<int>> orders(g.num_devices());
    std::vector<int> pool;
    for (int b = 0; b < k; ++b)
        if (waiting[b] == 0) pool.push_back(b);
    int scheduled = 0;
    while (!pool.empty()) {
        // Pick the block that can start first; ties by height, then longer block, then index.
        int best = -1;
        int64_t best_start = 0;
        for (int b : pool) {
            int64_t s = ready[b];
            for (int d : g.block(b).devices) s = std::max(s, device_free[d]);
            bool better = best < 0 || s < best_start ||
                          (s == best_start && (height[b] > height[best] ||
                                               (height[b] == height[best] && b < best)));
            if (better) {
                best = b;
                best_start = s;
            }
        }
        pool.erase(std::find(pool.begin(), pool.end(), best));
        int64_t end = best_start + g.block(best).time;
        for (int d : g.block(best).devices) {
            device_free[d] = end;
            orders[d].push_back(best);
        }
        done[best] = 1;
        ++scheduled;
        for (auto [s, delay] : succ[best]) {
            ready[s] = std::max(ready[s], end + delay);
            if (--waiting[s] == 0) pool.push_back(s);
        }
    }
    if (scheduled != k) return {};  // same-iteration rules form a cycle
    return orders;
}

}  // namespace

Repetend list_schedule_repetend(const Graph& g, const std::vector<int>& n) {
    const int k = g.num_blocks();
    if (static_cast<int>(n.size()) != k)
        throw std::invalid_argument("need one micro-batch index per block");
    std::vector<int64_t> release(k, 0);
    Repetend best;
    // Refine: cross-iteration inputs arrive at the times the previous round's steady state says.
    for (int round = 0; round < 3; ++round) {
        auto orders = list_order(g, n, release);
        if (orders.empty()) break;
        Repetend r = evaluate_repetend(g, n, orders);
        if (!r.feasible) break;
        if (!best.feasible || r.period < best.period) best = r;
        std::vector<int64_t> next(k, 0);
        for (const Edge& e : g.edges()) {
            int64_t h = n[e.from] - n[e.to];
            if (h > 0)
                next[e.to] = std::max(next[e.to], r.offsets[e.from] + g.block(e.from).time +
                                                      e.delay - h * r.period);
        }
        if (next == release) break;
        release = next;
    }
    if (!best.feasible) {
        best.indices = n;
        best.orders.assign(g.num_devices(), {});
    }
    return best;
}

// ---------------------------------------------------------------- completion

std::vector<Instance> warmup_blocks(const std::vector<int>& n) {
    std::vector<Instance> out;
    for (int b = 0; b < static_cast<int>(n.size()); ++b)
        for (int m = 0; m < n[b]; ++m) out.push_back({b, m});
    return out;
}

std::vector<Instance> cooldown_blocks(const std::vector<int>& n) {
    std::vector<Instance> out;
    int num_mb = n.empty() ? 0 : 1 + *std::max_element(n.begin(), n.end());
    for (int b = 0; b < static_cast<int>(n.size()); ++b)
        for (int m = n[b] + 1; m < num_mb; ++m) out.push_back({b, m});
    return out;
}

DeviceOrders periodic_orders(const Graph& g, const Repetend& r, int num_micro_batches) {
    if (static_cast<int>(r.orders.size()) != g.num_devices())
        throw std::invalid_argument("the repetend has no order");
    const int nr = r.num_micro_batches();
    DeviceOrders out(g.num_devices());
    for (int d = 0; d < g.num_devices(); ++d)
        for (int j = -(nr - 1); j < num_micro_batches; ++j)
            for (int b : r.orders[d]) {
                int m = j + r.indices[b];
                if (m >= 0 && m < num_micro_batches) out[d].push_back({b, m});
            }
    return out;
}

DeviceOrders extend(const Graph& g, const DeviceOrders& warmup, const Repetend& r,
                    const DeviceOrders& cooldown, int num_micro_batches) {
    const int D = g.num_devices();
    const int nr = r.num_micro_batches();
    if (num_micro_batches < nr)
        throw std::invalid_argument("extending a repetend of " + std::to_string(nr) +
                                    " micro-batches needs at least that many");
    if (static_cast<int>(warmup.size()) != D || static_cast<int>(cooldown.size()) != D ||
        static_cast<int>(r.orders.size()) != D)
        throw std::invalid_argument("warmup, repetend and cooldown need one order per device");
    DeviceOrders out(D);
    const int shift = num_micro_batches - nr;
    for (int d = 0; d < D; ++d) {
        out[d] = warmup[d];
        for (int j = 0; j <= shift; ++j)
            for (int b : r.orders[d]) out[d].push_back({b, j + r.indices[b]});
        for (const Instance& inst : cooldown[d]) out[d].push_back({inst.block, inst.mb + shift});
    }
    return out;
}

// ---------------------------------------------------------------- search

// Budgets count candidates; the search nodes spent finding them are capped in proportion so a
// budget bounds the work even where pruning leaves few candidates.
constexpr int64_t kNodesPerCandidate = 200;

Repetend search_repetends(const Graph& g, int num_mb, int64_t capacity, int64_t best_period,
                          int64_t target, int64_t max_candidates, RepetendSearchStats& stats,
                          double seconds) {
    RepetendEnumerator en(g, num_mb, capacity, best_period);
    en.set_time_limit(seconds);
    if (max_candidates > 0) en.set_node_limit(kNodesPerCandidate * max_candidates);
    Repetend best;
    std::vector<int> cand;
    while ((max_candidates <= 0 || stats.enumerated < max_candidates) && en.next(cand)) {
        ++stats.enumerated;
        Repetend r = list_schedule_repetend(g, cand);
        ++stats.evaluated;
        if (!r.feasible) continue;
        if (!memory_fits(g, r, capacity)) {
            ++stats.pruned_memory;
            continue;
        }
        if (best_period > 0 && r.period >= best_period) continue;
        best = r;
        best_period = r.period;
        en.set_period_below(best_period);
        if (best_period <= target) break;
    }
    stats.visited_nodes += en.visited_nodes();
    stats.out_of_time |= en.out_of_time();
    return best;
}

int64_t periodic_makespan(const Graph& g, const Repetend& r, int n, int64_t capacity) {
    EvalOptions opt;
    opt.memory_capacity = capacity;
    opt.complete_micro_batches = n;
    Evaluation ev = evaluate(g, periodic_orders(g, r, n), opt);
    return ev.ok ? ev.makespan : -1;
}

std::vector<Repetend> rank_repetends(const Graph& g, int num_mb, int64_t capacity,
                                     int64_t period, int n, int keep, int64_t max_candidates,
                                     RepetendSearchStats& stats, double seconds) {
    std::vector<std::pair<std::pair<int64_t, int>, Repetend>> kept;  // ((makespan, N_R), rep)
    if (n < num_mb) return {};
    RepetendEnumerator en(g, num_mb, capacity, period + 1);
    en.set_time_limit(seconds);
    if (max_candidates > 0) en.set_node_limit(kNodesPerCandidate * max_candidates);
    // Each candidate's periodic makespan costs O(n x blocks): check the time per candidate too.
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                              std::chrono::duration<double>(seconds > 0 ? seconds : 0));
    std::vector<int> cand;
    int64_t seen = 0;
    while ((max_candidates <= 0 || seen < max_candidates) && en.next(cand)) {
        if (seconds > 0 && seen > 0 && std::chrono::steady_clock::now() >= deadline) break;
        ++seen;
        Repetend r = list_schedule_repetend(g, cand);
        ++stats.evaluated;
        if (!r.feasible || r.period > period) continue;
        if (!memory_fits(g, r, capacity)) {
            ++stats.pruned_memory;
            continue;
        }
        int64_t makespan = periodic_makespan(g, r, n, capacity);
        if (makespan < 0) continue;
        auto key = std::make_pair(makespan, r.num_micro_batches());
        if (static_cast<int>(kept.size()) == keep && !(key < kept.back().first)) continue;
        kept.emplace_back(key, std::move(r));
        std::stable_sort(kept.begin(), kept.end(),
                         [](const auto& x, const auto& y) { return x.first < y.first; });
        if (static_cast<int>(kept.size()) > keep) kept.pop_back();
    }
    stats.enumerated += seen;
    stats.visited_nodes += en.visited_nodes();
    stats.out_of_time |= en.out_of_time();
    std::vector<Repetend> out;
    for (auto& item : kept) out.push_back(std::move(item.second));
    return out;
}

}  // namespace pyplan
