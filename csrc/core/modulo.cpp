#include "core/modulo.hpp"

#include <algorithm>
#include <chrono>
#include <numeric>
#include <stdexcept>

namespace pyplan {

Repetend repetend_from_starts(const Graph& g, const std::vector<int64_t>& start, int64_t period) {
    const int k = g.num_blocks();
    if (static_cast<int>(start.size()) != k || period <= 0)
        throw std::invalid_argument("need one start per block and a positive period");
    int64_t low = *std::min_element(start.begin(), start.end());
    std::vector<int64_t> lag(k), offset(k);
    int64_t max_lag = 0;
    for (int b = 0; b < k; ++b) {
        int64_t a = start[b] - (low / period) * period - (low < 0 && low % period ? period : 0);
        lag[b] = a / period;
        offset[b] = a % period;
        max_lag = std::max(max_lag, lag[b]);
    }
    std::vector<int> indices(k);
    for (int b = 0; b < k; ++b) indices[b] = static_cast<int>(max_lag - lag[b]);
    std::vector<std::vector<int>> orders(g.num_devices());
    for (int d = 0; d < g.num_devices(); ++d) {
        orders[d] = g.blocks_on(d);
        std::stable_sort(orders[d].begin(), orders[d].end(),
                         [&](int x, int y) { return offset[x] < offset[y]; });
    }
    return evaluate_repetend(g, indices, orders);
}

namespace {

class ModuloSearch {
  public:
    ModuloSearch(const Graph& g, int64_t period, int max_mb, int64_t capacity, int64_t budget,
                 ModuloStats& stats, double seconds, int64_t work_budget)
        : g_(g), T_(period), max_lag_(max_mb - 1), capacity_(capacity), budget_(budget),
          work_budget_(work_budget), stats_(stats), timed_(seconds > 0),
          deadline_(std::chrono::steady_clock::now() +
                    std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                        std::chrono::duration<double>(timed_ ? seconds : 0.0))) {
        const int k = g.num_blocks();
        auto topo = g.topological_order();
        std::vector<int> pos(k);
        for (int i = 0; i < k; ++i) pos[topo[i]] = i;
        // Blocks spanning several devices are the hardest to fit: place their offsets first.
        for (int b : topo)
            if (g.block(b).devices.size() > 1) order_.push_back(b);
        std::stable_sort(order_.begin(), order_.end(), [&](int x, int y) {
            return g.block(x).devices.size() > g.block(y).devices.size();
        });
        for (int b : topo)
            if (g.block(b).devices.size() == 1) order_.push_back(b);
        offset_.assign(k, -1);
        start_.assign(k, kUnknown);
        for (const Block& blk : g.blocks()) cells_ = cells_ && blk.time <= kShortBlock;
        if (cells_)
            table_.assign(g.num_devices(), std::vector<int>(static_cast<size_t>(T_), -1));
        else
            busy_.assign(g.num_devices(), {});
        for (size_t i = 0; i < g.rules().size(); ++i) {
            rules_of_.resize(k);
            rules_of_[g.rules()[i].before].push_back(static_cast<int>(i));
            rules_of_[g.rules()[i].after].push_back(static_cast<int>(i));
        }
        rules_of_.resize(k);
    }

    bool run() {
        for (const Block& b : g_.blocks())
            if (b.time > T_) return false;
        return place(0);
    }

    const std::vector<int64_t>& starts() const { return start_; }
    Repetend result;

  private:
    static constexpr int64_t kUnknown = INT64_MIN;
    static constexpr int64_t kShortBlock = 16;  // time steps: up to this, cells are cheaper
    struct Busy {
        int64_t off, time;
        int who;
    };

    // How many offsets from `off` on (at most T) block b cannot start at, because it would
    // overlap a placed block modulo the period: 0 when it fits at `off`. Short blocks are
    // checked on a table of cells (one per time step of the period) one offset at a time; where
    // some block is long (a slow device's, or measured costs), occupancy is kept as intervals
    // instead, so that a check costs the blocks placed on its devices, not the block's time,
    // and a run of offsets that cannot fit is skipped at once. Both answer the same.
    int64_t blocked(int b, int64_t off) const {
        const int64_t len = g_.block(b).time;
        if (cells_) {
            for (int d : g_.block(b).devices)
                for (int64_t t = 0; t < len; ++t)
                    if (table_[d][(off + t) % T_] >= 0) return 1;
            return 0;
        }
        int64_t pos = off;
        for (bool moved = true; moved && pos - off < T_;) {
            moved = false;
            for (int d : g_.block(b).devices)
                for (const Busy& x : busy_[d]) {
                    // x's first occurrence at or after pos, and the one before it
                    int64_t r = ((x.off - pos) % T_ + T_) % T_;
                    int64_t end = r < len ? pos + r + x.time
                                          : (r - T_ + x.time > 0 ? pos + r - T_ + x.time : pos);
                    if (end > pos) {
                        pos = end;  // every start before x ends overlaps it too
                        moved = true;
                    }
                }
        }
        return std::min(pos - off, T_);
    }
    void mark(int b, int64_t off, int who) {
        for (int d : g_.block(b).devices) {
            if (cells_) {
                for (int64_t t = 0; t < g_.block(b).time; ++t) table_[d][(off + t) % T_] = who;
            } else if (who >= 0) {
                busy_[d].push_back({off % T_, g_.block(b).time, who});
            } else {
                for (size_t i = busy_[d].size(); i-- > 0;)
                    if (busy_[d][i].who == b) {
                        busy_[d].erase(busy_[d].begin() + static_cast<std::ptrdiff_t>(i));
                        break;
                    }
            }
        }
    }

    // Forward checking: the unplaced blocks of a device must still pack into its free slots.
    // Packing is itself a search; past kPackSteps it answers "maybe" (no pruning), which only
    // costs pruning power, never a schedule.
    static constexpr int64_t kPackSteps = 4096;
    bool can_pack(int d) {
        std::vector<int> rest;
        for (int b : g_.blocks_on(d))
            if (offset_[b] < 0) rest.push_back(b);
        std::sort(rest.begin(), rest.end(),
                  [&](int x, int y) { return g_.block(x).time > g_.block(y).time; });
        pack_steps_ = 0;
        return pack(rest, 0);
    }
    bool pack(const std::vector<int>& rest, size_t i) {
        if (i == rest.size() || ++pack_steps_ > kPackSteps || over()) return true;
        const int b = rest[i];
        for (int64_t off = 0; off < T_; ++off) {
            if (int64_t skip = std::min(blocked(b, off), T_ - off)) {
                stats_.work += skip;  // (each offset tried counts, as it always has)
                off += skip - 1;
                continue;
            }
            ++stats_.work;
            mark(b, off, b);
            bool ok = pack(rest, i + 1);
            mark(b, off, -1);
            if (ok) return true;
        }
        return false;
    }
    bool devices_can_pack(int b) {
        for (int d : g_.block(b).devices)
            if (!can_pack(d)) return false;
        return true;
    }

    // Absolute start of a placed block, resolving spanning blocks from their predecessors.
    int64_t resolve(int b) {
        if (start_[b] != kUnknown) return start_[b];
        if (offset_[b] < 0) return kUnknown;
        int64_t earliest = 0;
        for (size_t i = 0; i < g_.predecessors(b).size(); ++i) {
            int p = g_.predecessors(b)[i];
            int64_t s = resolve(p);
            if (s == kUnknown) return kUnknown;
            earliest = std::max(earliest, s + g_.block(p).time + g_.predecessor_delays(b)[i]);
        }
        int64_t s = earliest + ((offset_[b] - earliest % T_) % T_ + T_) % T_;
        resolved_.push_back(b);
        return start_[b] = s;
    }

    // Order rules between resolved blocks: before[m+a] ends before after[m+b] starts.
    bool rules_hold(int b) {
        for (int i : rules_of_[b]) {
            const OrderRule& r = g_.rules()[i];
            int64_t sa = start_[r.before], sb = start_[r.after];
            if (sa == kUnknown || sb == kUnknown) continue;
            if (sb - sa < g_.block(r.before).time + (r.before_shift - r.after_shift) * T_)
                return false;
        }
        return true;
    }

    bool lag_ok(int b) const { return start_[b] / T_ <= max_lag_; }

    // Out of nodes or of time (the clock is read every 64 calls): stop, as if exhausted.
    bool over() {
        if (!stats_.budget_exhausted &&
            (stats_.nodes >= budget_ || (work_budget_ > 0 && stats_.work >= work_budget_) ||
             (timed_ && (++ticks_ & 63) == 0 && std::chrono::steady_clock::now() >= deadline_)))
            stats_.budget_exhausted = true;
        return stats_.budget_exhausted;
    }

    bool place(size_t depth) {
        if (over()) return false;
        if (depth == order_.size()) return finish();
        const int b = order_[depth];
        const Block& blk = g_.block(b);
        if (blk.devices.size() > 1) {
            for (int64_t off = 0; off < T_; ++off) {
                if (int64_t skip = blocked(b, off)) {
                    off += skip - 1;
                    continue;
                }
                ++stats_.nodes;
                ++stats_.work;
                offset_[b] = off;
                mark(b, off, b);
                if (devices_can_pack(b) && place(depth + 1)) return true;
                mark(b, off, -1);
                offset_[b] = -1;
                if (stats_.budget_exhausted) return false;
            }
            return false;
        }
        int64_t earliest = 0;
        size_t mark_resolved = resolved_.size();
        for (size_t i = 0; i < g_.predecessors(b).size(); ++i) {
            int p = g_.predecessors(b)[i];
            int64_t s = resolve(p);
            earliest = std::max(earliest, s + g_.block(p).time + g_.predecessor_delays(b)[i]);
        }
        for (int i : rules_of_[b]) {  // placed rule partners that must finish first
            const OrderRule& r = g_.rules()[i];
            if (r.after != b || r.before == b) continue;
            int64_t sa = resolve(r.before);
            if (sa != kUnknown)
                earliest = std::max(earliest, sa + g_.block(r.before).time +
                                                  (r.before_shift - r.after_shift) * T_);
        }
        bool ok = false;
        for (int64_t delta = 0; delta < T_ && !ok; ++delta) {
            int64_t s = earliest + delta;
            int64_t off = s % T_;
            if (int64_t skip = blocked(b, off)) {
                delta += skip - 1;
                continue;
            }
            ++stats_.nodes;
            ++stats_.work;
            offset_[b] = off;
            start_[b] = s;
            if (!lag_ok(b)) {
                start_[b] = kUnknown;
                offset_[b] = -1;
                break;  // later candidates only grow the lag
            }
            if (rules_hold(b)) {
                mark(b, off, b);
                ok = devices_can_pack(b) && place(depth + 1);
                if (!ok) mark(b, off, -1);
            }
            if (!ok) {
                start_[b] = kUnknown;
                offset_[b] = -1;
                if (stats_.budget_exhausted) break;
            }
        }
        if (!ok) unresolve(mark_resolved);
        return ok;
    }

    void unresolve(size_t keep) {
        while (resolved_.size() > keep) {
            start_[resolved_.back()] = kUnknown;
            resolved_.pop_back();
        }
    }

    bool finish() {
        size_t keep = resolved_.size();
        stats_.work += int64_t{g_.num_blocks()} * static_cast<int64_t>(g_.edges().size() + 1);
        for (int b = 0; b < g_.num_blocks(); ++b) {
            if (resolve(b) == kUnknown || !lag_ok(b) || !rules_hold(b)) {
                unresolve(keep);
                return false;
            }
        }
        Repetend r = repetend_from_starts(g_, start_, T_);
        if (!r.feasible || r.period > T_ || !memory_fits(g_, r, capacity_)) {
            unresolve(keep);
            return false;
        }
        result = std::move(r);
        return true;
    }

    const Graph& g_;
    int64_t T_;
    int64_t max_lag_;
    int64_t capacity_;
    int64_t budget_;
    int64_t work_budget_;
    ModuloStats& stats_;
    bool timed_;
    std::chrono::steady_clock::time_point deadline_;
    int64_t ticks_ = 0;
    int64_t pack_steps_ = 0;
    std::vector<int> order_;
    std::vector<int64_t> offset_, start_;
    std::vector<int> resolved_;
    bool cells_ = true;                       // every block short: the table, else busy_
    std::vector<std::vector<int>> table_;     // per device and time step: the block there
    std::vector<std::vector<Busy>> busy_;  // per device: placed blocks' offsets modulo T
    std::vector<std::vector<int>> rules_of_;
};

}  // namespace

Repetend modulo_schedule(const Graph& g, int64_t period, int max_micro_batches,
                         int64_t memory_capacity, int64_t node_budget, ModuloStats& stats,
                         double seconds, int64_t work_budget) {
    if (period <= 0) throw std::invalid_argument("the period must be positive");
    if (max_micro_batches < 1) throw std::invalid_argument("need at least one micro-batch");
    if (static_cast<int>(g.topological_order().size()) != g.num_blocks())
        throw std::invalid_argument("the dependency graph has a cycle");
    ++stats.periods_tried;
    stats.budget_exhausted = false;
    int64_t before = stats.nodes;
    ModuloSearch search(g, period, max_micro_batches, memory_capacity, before + node_budget,
                        stats, seconds, work_budget > 0 ? stats.work + work_budget : 0);
    if (search.run()) return search.result;
    Repetend none;
    none.orders.assign(g.num_devices(), {});
    return none;
}

}  // namespace pyplan
