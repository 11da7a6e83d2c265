#include "core/evaluate.hpp"

#include <algorithm>
#include <stdexcept>

namespace pyplan {

std::string instance_name(const Graph& graph, Instance inst) {
    return graph.block(inst.block).name + "@" + std::to_string(inst.mb);
}

namespace {

struct Layout {
    int k = 0;
    int num_mb = 0;
    int id(Instance i) const { return i.mb * k + i.block; }
    Instance inst(int id) const { return {id % k, id / k}; }
};

// Check the orders are well formed and return the set of scheduled instances.
std::vector<char> check_orders(const Graph& g, const DeviceOrders& orders, const Layout& lay,
                               int complete) {
    if (static_cast<int>(orders.size()) != g.num_devices())
        throw std::invalid_argument("expected orders for " + std::to_string(g.num_devices()) +
                                    " devices, got " + std::to_string(orders.size()));
    const size_t n = static_cast<size_t>(lay.k) * lay.num_mb;
    std::vector<int> stamp(n, -1);
    std::vector<int> count(n, 0);
    for (int d = 0; d < g.num_devices(); ++d) {
        for (const Instance& inst : orders[d]) {
            const Block& blk = g.block(inst.block);
            if (!std::binary_search(blk.devices.begin(), blk.devices.end(), d))
                throw std::invalid_argument(instance_name(g, inst) + " is scheduled on device " +
                                            std::to_string(d) + " but placed elsewhere");
            int id = lay.id(inst);
            if (stamp[id] == d)
                throw std::invalid_argument(instance_name(g, inst) +
                                            " appears twice on device " + std::to_string(d));
            stamp[id] = d;
            ++count[id];
        }
    }
    std::vector<char> present(n, 0);
    for (size_t id = 0; id < n; ++id) {
        Instance inst = lay.inst(static_cast<int>(id));
        const int want = static_cast<int>(g.block(inst.block).devices.size());
        if (count[id] != 0 && count[id] != want)
            throw std::invalid_argument(instance_name(g, inst) + " is missing on some of its " +
                                        std::to_string(want) + " devices");
        if (count[id] == 0 && inst.mb < complete)
            throw std::invalid_argument(instance_name(g, inst) + " is not scheduled");
        present[id] = count[id] != 0;
    }
    return present;
}

}  // namespace

Evaluation evaluate(const Graph& g, const DeviceOrders& orders, const EvalOptions& opt) {
    Layout lay;
    lay.k = g.num_blocks();
    lay.num_mb = std::max(opt.complete_micro_batches, 0);
    for (const auto& dev : orders)
        for (const Instance& inst : dev) {
            if (inst.block < 0 || inst.block >= lay.k)
                throw std::out_of_range("unknown block index " + std::to_string(inst.block));
            if (inst.mb < 0)
                throw std::out_of_range("negative micro-batch index " + std::to_string(inst.mb));
            lay.num_mb = std::max(lay.num_mb, inst.mb + 1);
        }
    const int D = g.num_devices();
    if (!opt.initial_memory.empty() && static_cast<int>(opt.initial_memory.size()) != D)
        throw std::invalid_argument("initial_memory needs one value per device");
    std::vector<char> present = check_orders(g, orders, lay, opt.complete_micro_batches);

    const int n = lay.k * lay.num_mb;
    // Each instance waits for its scheduled dependencies (the DAG inside a micro-batch plus order
    // rules) and to reach the head of every device it runs on. Successors are found on the fly.
    std::vector<std::vector<int>> rules_from(lay.k), rules_to(lay.k);
    if (opt.enforce_rules)
        for (size_t i = 0; i < g.rules().size(); ++i) {
            rules_from[g.rules()[i].before].push_back(static_cast<int>(i));
            rules_to[g.rules()[i].after].push_back(static_cast<int>(i));
        }
    // The instance a rule links to, or -1: rule variable m = mb - shift must be >= min_m.
    auto rule_peer = [&](const OrderRule& r, int mb, bool forward) {
        int m = mb - (forward ? r.before_shift : r.after_shift);
        int other = m + (forward ? r.after_shift : r.before_shift);
        if (m < r.min_m || other < 0 || other >= lay.num_mb) return -1;
        int id = lay.id({forward ? r.after : r.before, other});
        return present[id] ? id : -1;
    };
    std::vector<int> waiting(n, 0);
    for (int id = 0; id < n; ++id) {
        if (!present[id]) continue;
        Instance inst = lay.inst(id);
        int w = static_cast<int>(g.block(inst.block).devices.size());
        for (int p : g.predecessors(inst.block)) w += present[lay.id({p, inst.mb})];
        for (int ri : rules_to[inst.block]) {
            int peer = rule_peer(g.rules()[ri], inst.mb, false);
            w += (peer >= 0 && peer != id);
        }
        waiting[id] = w;
    }
    // fn(successor, delay): the delay is the dependency's transfer time (0 for order rules).
    auto for_each_successor = [&](int id, auto&& fn) {
        Instance inst = lay.inst(id);
        const auto& succ = g.successors(inst.block);
        for (size_t i = 0; i < succ.size(); ++i) {
            int sid = lay.id({succ[i], inst.mb});
            if (present[sid]) fn(sid, g.successor_delays(inst.block)[i]);
        }
        for (int ri : rules_from[inst.block]) {
            int peer = rule_peer(g.rules()[ri], inst.mb, true);
            if (peer >= 0 && peer != id) fn(peer, int64_t{0});
        }
    };

    Evaluation ev;
    ev.num_micro_batches = lay.num_mb;
    ev.start.assign(n, -1);
    ev.busy.assign(D, 0);
    std::vector<int64_t> memory = opt.initial_memory.empty() ? std::vector<int64_t>(D, 0)
                                                             : opt.initial_memory;
    for (int d = 0; d < D; ++d) memory[d] += g.static_memory(d);  // resident all along
    ev.peak_memory = memory;
    std::vector<int64_t> ready(n, 0), device_free(D, 0);
    std::vector<size_t> head(D, 0);
    std::vector<int> queue;
    int64_t total = 0;
    for (int id = 0; id < n; ++id) total += present[id];
    queue.reserve(total);
    for (int d = 0; d < D; ++d)
        if (!orders[d].empty()) {
            int id = lay.id(orders[d][0]);
            if (--waiting[id] == 0) queue.push_back(id);
        }

    size_t qi = 0;
    while (qi < queue.size()) {
        int id = queue[qi++];
        Instance inst = lay.inst(id);
        const Block& blk = g.block(inst.block);
        int64_t start = ready[id];
        for (int d : blk.devices) start = std::max(start, device_free[d]);
        for (int d : blk.devices) {
            memory[d] += blk.memory;
            const int64_t room = g.limit(d, opt.memory_capacity);
            if (room >= 0 && memory[d] > room) {
                ev.ok = false;
                ev.reason = instance_name(g, inst) + " cannot start on device " +
                            std::to_string(d) + ": memory would reach " +
                            std::to_string(memory[d]) + " > capacity " + std::to_string(room);
                return ev;
            }
            ev.peak_memory[d] = std::max(ev.peak_memory[d], memory[d]);
        }
        ev.start[id] = start;
        const int64_t end = start + blk.time;
        ev.makespan = std::max(ev.makespan, end);
        for (int d : blk.devices) {
            device_free[d] = end;
            ev.busy[d] += blk.time;
            if (++head[d] < orders[d].size()) {
                int next = lay.id(orders[d][head[d]]);
                if (--waiting[next] == 0) queue.push_back(next);
            }
        }
        for_each_successor(id, [&](int s, int64_t delay) {
            ready[s] = std::max(ready[s], end + delay);
            if (--waiting[s] == 0) queue.push_back(s);
        });
    }
    ev.scheduled_blocks = static_cast<int64_t>(queue.size());
    ev.final_memory = memory;
    if (static_cast<int64_t>(queue.size()) != total) {
        // Follow "waits for" links from a stalled device head until one repeats: that is the cycle.
        std::vector<std::vector<int>> pred(n);
        for (int p = 0; p < n; ++p)
            if (present[p]) for_each_successor(p, [&](int s, int64_t) { pred[s].push_back(p); });
        std::vector<int> seen_at(n, -1);
        std::vector<std::string> chain;
        std::vector<int> ahead, waiter;  // per link: who holds a device (or -1) and who waits
        int cur = -1;
        for (int d = 0; d < D && cur < 0; ++d)
            if (head[d] < orders[d].size()) cur = lay.id(orders[d][head[d]]);
        while (cur >= 0 && seen_at[cur] < 0) {
            seen_at[cur] = static_cast<int>(chain.size());
            Instance inst = lay.inst(cur);
            int next = -1;
            std::string why;
            for (int d : g.block(inst.block).devices) {
                int h = lay.id(orders[d][head[d]]);
                if (h != cur) {
                    next = h;
                    why = " (ahead of it on device " + std::to_string(d) + ")";
                    break;
                }
            }
            if (next < 0)
                for (int p : pred[cur])
                    if (ev.start[p] < 0) {
                        next = p;
                        why = " (dependency)";
                        break;
                    }
            ahead.push_back(why == " (dependency)" || next < 0 ? -1 : next);
            waiter.push_back(cur);
            chain.push_back(instance_name(g, inst) + " waits for " +
                            (next >= 0 ? instance_name(g, lay.inst(next)) : "?") + why);
            cur = next;
        }
        ev.ok = false;
        std::string text = "deadlock: ";
        size_t from = cur >= 0 ? static_cast<size_t>(seen_at[cur]) : 0;
        for (size_t i = from; i < chain.size(); ++i) {
            text += (i > from ? "; " : "") + chain[i];
            if (ahead[i] >= 0)
                ev.deadlock_holds.push_back({lay.inst(ahead[i]), lay.inst(waiter[i])});
        }
        ev.reason = text;
        return ev;
    }
    ev.ok = true;
    int64_t busy_total = 0;
    for (int64_t b : ev.busy) busy_total += b;
    if (ev.makespan > 0)
        ev.bubble_rate = 1.0 - static_cast<double>(busy_total) /
                                   (static_cast<double>(D) * static_cast<double>(ev.makespan));
    return ev;
}

}  // namespace pyplan
