#include "core/phases.hpp"

#include <algorithm>
#include <functional>
#include <queue>
#include <stdexcept>
#include <tuple>

namespace pyplan {

namespace {
constexpr int64_t kNever = -(int64_t{1} << 62);  // no constraint (far below any time)
}  // namespace

DeviceOrders list_schedule_phase(const Graph& g, const std::vector<Instance>& phase,
                                 const std::vector<int64_t>& start, std::vector<int64_t> free,
                                 int num_micro_batches, bool reverse) {
    const int K = g.num_blocks();
    const int64_t n = num_micro_batches;
    if (n < 1 || static_cast<int64_t>(start.size()) != n * K ||
        static_cast<int>(free.size()) != g.num_devices())
        throw std::invalid_argument("need a start per instance and a free time per device");
    std::vector<int> slot(static_cast<size_t>(n * K), -1);  // instance -> position in phase
    for (size_t i = 0; i < phase.size(); ++i) {
        const Instance& x = phase[i];
        if (x.block < 0 || x.block >= K || x.mb < 0 || x.mb >= n)
            throw std::out_of_range("a phase instance is not in the schedule");
        int& s = slot[static_cast<size_t>(x.mb) * K + x.block];
        if (s >= 0) throw std::invalid_argument("an instance appears twice in the phase");
        s = static_cast<int>(i);
    }
    // Order rules by the block that must wait (forward: `after`; reversed: `before`).
    std::vector<std::vector<const OrderRule*>> rules_of(K);
    for (const OrderRule& r : g.rules()) rules_of[reverse ? r.before : r.after].push_back(&r);

    const size_t P = phase.size();
    std::vector<int64_t> ready(P, kNever);
    std::vector<int> waiting(P, 0);
    std::vector<std::vector<std::pair<int, int64_t>>> released(P);
    auto done = [&](int b, int64_t m) {  // when an instance outside the phase lets others go
        int64_t s = start[static_cast<size_t>(m) * K + b];
        return reverse ? -s : s + g.block(b).time;
    };
    auto need = [&](int i, int b, int64_t m, int64_t delay) {
        if (m < 0 || m >= n) return;  // a micro-batch the schedule does not have
        int j = slot[static_cast<size_t>(m) * K + b];
        if (j == i) return;
        if (j >= 0) {
            ++waiting[i];
            released[j].push_back({i, delay});
        } else {
            ready[i] = std::max(ready[i], done(b, m) + delay);
        }
    };
    for (size_t i = 0; i < P; ++i) {
        const int b = phase[i].block;
        const int64_t m = phase[i].mb;
        const auto& others = reverse ? g.successors(b) : g.predecessors(b);
        const auto& delays = reverse ? g.successor_delays(b) : g.predecessor_delays(b);
        for (size_t k = 0; k < others.size(); ++k)
            need(static_cast<int>(i), others[k], m, delays[k]);
        for (const OrderRule* r : rules_of[b]) {  // before[v + bs] ends before after[v + as]
            const int own = reverse ? r->before_shift : r->after_shift;
            const int other = reverse ? r->after_shift : r->before_shift;
            if (m - own >= r->min_m)
                need(static_cast<int>(i), reverse ? r->after : r->before, m - own + other, 0);
        }
    }

    const std::vector<int64_t> ahead = reverse ? g.heads() : g.tails();
    auto earliest = [&](size_t i) {
        int64_t t = ready[i];
        for (int d : g.block(phase[i].block).devices) t = std::max(t, free[d]);
        return t;
    };
    using Entry = std::tuple<int64_t, int64_t, int64_t, int, size_t>;  // start, -ahead, mb, block
    std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
    auto push = [&](size_t i) {
        const Instance& x = phase[i];
        heap.push({earliest(i), -ahead[x.block], reverse ? -x.mb : x.mb, x.block, i});
    };
    for (size_t i = 0; i < P; ++i)
        if (waiting[i] == 0) push(i);
    std::vector<int64_t> begin(P, kNever);
    std::vector<size_t> scheduled;
    while (!heap.empty()) {
        Entry top = heap.top();
        heap.pop();
        const size_t i = std::get<4>(top);
        // Starts only grow as devices fill up: a stale entry goes back with its new start.
        const int64_t now = earliest(i);
        if (now != std::get<0>(top)) {
            std::get<0>(top) = now;
            heap.push(top);
            continue;
        }
        begin[i] = now;
        scheduled.push_back(i);
        const int64_t end = now + g.block(phase[i].block).time;
        for (int d : g.block(phase[i].block).devices) free[d] = end;
        for (auto [j, delay] : released[i]) {
            ready[j] = std::max(ready[j], end + delay);
            if (--waiting[j] == 0) push(j);
        }
    }
    auto key = [&](size_t i) { return std::make_tuple(begin[i], phase[i].mb, phase[i].block); };
    std::sort(scheduled.begin(), scheduled.end(), [&](size_t a, size_t b) {
        return reverse ? key(a) > key(b) : key(a) < key(b);
    });
    DeviceOrders orders(g.num_devices());
    for (size_t i : scheduled)
        for (int d : g.block(phase[i].block).devices) orders[d].push_back(phase[i]);
    return orders;
}

}  // namespace pyplan
