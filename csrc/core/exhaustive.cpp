#include "core/exhaustive.hpp"

#include <algorithm>
#include <stdexcept>
#include <utility>

namespace pyplan {

namespace {

constexpr int kMaxInstances = 4096;  // the search recurses once per instance

class Exhaustive {
  public:
    Exhaustive(const Graph& g, int n, int64_t target, const std::vector<int64_t>& headroom,
               const std::vector<char>& is_forward, int64_t sync, int64_t budget,
               const std::vector<std::pair<int, int>>& after)
        : g_(g), K_(g.num_blocks()), n_(n), N_(g.num_blocks() * n), D_(g.num_devices()),
          target_(target), headroom_(headroom), budget_(budget) {
        kept_.resize(N_);
        for (auto [x, y] : after) kept_[y].push_back(x);
        topo_ = g.topological_order();
        // Instances in an order every precedence (dependencies, micro-batch order, the kept
        // pairs) goes forward in: release times are computed along it.
        for (int m = 0; m < n; ++m)
            for (int b : topo_) order_.push_back(m * K_ + b);
        if (!after.empty()) order_ = instance_order();
        const auto tails = g.tails();
        after_.resize(K_);
        for (int b = 0; b < K_; ++b) {
            const int64_t own = g.block(b).time + (is_forward[b] ? 0 : sync);
            after_[b] = std::max(g.block(b).time + tails[b], own);  // start to the end it forces
        }
        start_.assign(N_, -1);
        release_.assign(N_, 0);
        free_.assign(D_, 0);
        used_.assign(D_, 0);
        remaining_.assign(D_, 0);
        for (int b = 0; b < K_; ++b)
            for (int d : g.block(b).devices) remaining_[d] += g.block(b).time * n;
        candidates_.resize(N_ + 1);
        saved_.resize(N_ + 1);
    }

    ExhaustiveResult run() {
        ExhaustiveResult out;
        if (static_cast<int>(order_.size()) < N_) {  // the kept pairs close a cycle
            out.status = ExhaustiveResult::kNone;
            return out;
        }
        bool found = dfs(0, -1, -1);
        out.nodes = nodes_;
        if (found) {
            out.status = ExhaustiveResult::kFound;
            out.start = start_;
        } else {
            out.status = out_of_nodes_ ? ExhaustiveResult::kUnknown : ExhaustiveResult::kNone;
        }
        return out;
    }

  private:
    // Kahn's algorithm over the instances and every precedence between them (shorter than
    // N_ when there is a cycle).
    std::vector<int> instance_order() const {
        std::vector<std::vector<int>> next(N_);
        std::vector<int> indegree(N_, 0);
        auto edge = [&](int x, int y) {
            next[x].push_back(y);
            ++indegree[y];
        };
        for (int m = 0; m < n_; ++m)
            for (int b = 0; b < K_; ++b) {
                for (int p : g_.predecessors(b)) edge(m * K_ + p, m * K_ + b);
                if (m > 0) edge((m - 1) * K_ + b, m * K_ + b);
            }
        for (int y = 0; y < N_; ++y)
            for (int x : kept_[y]) edge(x, y);
        std::vector<int> out;
        for (int i = 0; i < N_; ++i)
            if (indegree[i] == 0) out.push_back(i);
        for (size_t at = 0; at < out.size(); ++at)
            for (int y : next[out[at]])
                if (--indegree[y] == 0) out.push_back(y);
        return out;
    }

    // The earliest instance i can start now, from its scheduled inputs and devices; -1 when an
    // input (or the block's previous micro-batch) is not scheduled yet.
    int64_t ready(int i) const {
        const int b = i % K_, m = i / K_;
        if (m > 0 && start_[i - K_] < 0) return -1;
        int64_t est = 0;
        const auto& preds = g_.predecessors(b);
        const auto& delays = g_.predecessor_delays(b);
        for (size_t x = 0; x < preds.size(); ++x) {
            const int j = m * K_ + preds[x];
            if (start_[j] < 0) return -1;
            est = std::max(est, start_[j] + g_.block(preds[x]).time + delays[x]);
        }
        for (int x : kept_[i]) {
            if (start_[x] < 0) return -1;
            est = std::max(est, start_[x] + g_.block(x % K_).time);
        }
        for (int d : g_.block(b).devices) est = std::max(est, free_[d]);
        return est;
    }

    bool fits(int b) const {
        const int64_t delta = g_.block(b).memory;
        for (int d : g_.block(b).devices)
            if (headroom_[d] >= 0 && used_[d] + delta > headroom_[d]) return false;
        return true;
    }

    // A lower bound on the makespan of any completion: each unscheduled instance no earlier
    // than its inputs (scheduled or not), its devices and the last start allow, plus what it
    // forces after it; and each device's remaining load run back to back.
    int64_t lower(int64_t last) {
        int64_t bound = 0;
        std::vector<int64_t>& earliest = device_release_;
        std::vector<int64_t>& least_tail = device_tail_;
        earliest.assign(D_, INT64_MAX);
        least_tail.assign(D_, INT64_MAX);
        for (int i : order_) {
                const int b = i % K_, m = i / K_;
                if (start_[i] >= 0) continue;
                int64_t r = std::max<int64_t>(last, 0);
                if (m > 0) {
                    const int p = i - K_;
                    r = std::max(r, (start_[p] >= 0 ? start_[p] : release_[p]) +
                                        g_.block(b).time);
                }
                const auto& preds = g_.predecessors(b);
                const auto& delays = g_.predecessor_delays(b);
                for (size_t x = 0; x < preds.size(); ++x) {
                    const int j = m * K_ + preds[x];
                    r = std::max(r, (start_[j] >= 0 ? start_[j] : release_[j]) +
                                        g_.block(preds[x]).time + delays[x]);
                }
                for (int x : kept_[i])
                    r = std::max(r, (start_[x] >= 0 ? start_[x] : release_[x]) +
                                        g_.block(x % K_).time);
                for (int d : g_.block(b).devices) r = std::max(r, free_[d]);
                release_[i] = r;
                bound = std::max(bound, r + after_[b]);
                const int64_t tail = after_[b] - g_.block(b).time;
                for (int d : g_.block(b).devices) {
                    earliest[d] = std::min(earliest[d], r);
                    least_tail[d] = std::min(least_tail[d], tail);
                }
        }
        for (int d = 0; d < D_; ++d)
            if (earliest[d] != INT64_MAX)
                bound = std::max(bound, earliest[d] + remaining_[d] + least_tail[d]);
        return bound;
    }

    bool dfs(int count, int64_t last, int last_i) {
        if (++nodes_ > budget_) {
            out_of_nodes_ = true;
            return false;
        }
        if (count == N_) return true;
        if (lower(last) > target_) return false;
        auto& options = candidates_[count];
        options.clear();
        for (int i = 0; i < N_; ++i) {
            if (start_[i] >= 0) continue;
            const int64_t est = ready(i);
            // Semi-active schedules listed by (start, instance): each is met exactly once.
            if (est < 0 || est < last || (est == last && i < last_i)) continue;
            const int b = i % K_;
            if (est + after_[b] > target_ || !fits(b)) continue;
            options.push_back({est, i});
        }
        std::sort(options.begin(), options.end());
        for (size_t x = 0; x < options.size(); ++x) {
            const auto [est, i] = candidates_[count][x];
            const int b = i % K_;
            const Block& blk = g_.block(b);
            auto& undo = saved_[count];
            undo.clear();
            for (int d : blk.devices) {
                undo.push_back({free_[d], used_[d]});
                free_[d] = est + blk.time;
                used_[d] += blk.memory;
                remaining_[d] -= blk.time;
            }
            start_[i] = est;
            if (dfs(count + 1, est, i)) return true;
            start_[i] = -1;
            for (size_t y = 0; y < blk.devices.size(); ++y) {
                const int d = blk.devices[y];
                free_[d] = saved_[count][y].first;
                used_[d] = saved_[count][y].second;
                remaining_[d] += blk.time;
            }
            if (out_of_nodes_) return false;
        }
        return false;
    }

    const Graph& g_;
    const int K_, n_, N_, D_;
    const int64_t target_;
    const std::vector<int64_t>& headroom_;
    const int64_t budget_;
    std::vector<int> topo_, order_;
    std::vector<std::vector<int>> kept_;  // per instance: instances it must follow
    std::vector<int64_t> after_, start_, release_, free_, used_, remaining_;
    std::vector<int64_t> device_release_, device_tail_;
    std::vector<std::vector<std::pair<int64_t, int>>> candidates_;  // per depth
    std::vector<std::vector<std::pair<int64_t, int64_t>>> saved_;   // per depth: free, used
                                                                    // of the devices it changed
    int64_t nodes_ = 0;
    bool out_of_nodes_ = false;
};

}  // namespace

ExhaustiveResult schedule_within(const Graph& g, int n, int64_t target,
                                 const std::vector<int64_t>& headroom,
                                 const std::vector<char>& is_forward, int64_t sync_time,
                                 int64_t node_budget,
                                 const std::vector<std::pair<int, int>>& after) {
    if (n < 1) throw std::invalid_argument("need at least one micro-batch");
    if (int64_t{g.num_blocks()} * n > kMaxInstances)
        throw std::invalid_argument("more than 4096 instances: too many to search exhaustively");
    if (static_cast<int>(headroom.size()) != g.num_devices())
        throw std::invalid_argument("need one headroom per device");
    if (static_cast<int>(is_forward.size()) != g.num_blocks())
        throw std::invalid_argument("need is_forward for every block");
    if (!g.rules().empty()) throw std::invalid_argument("order rules are not supported here");
    if (sync_time < 0 || sync_time > kMaxTime) throw std::invalid_argument("bad sync time");
    if (static_cast<int>(g.topological_order().size()) != g.num_blocks())
        throw std::invalid_argument("the dependency graph has a cycle");
    const int N = g.num_blocks() * n;
    for (auto [x, y] : after)
        if (x < 0 || x >= N || y < 0 || y >= N || x == y)
            throw std::out_of_range("an order pair names an instance out of range");
    Exhaustive search(g, n, target, headroom, is_forward, sync_time, node_budget, after);
    return search.run();
}

}  // namespace pyplan
