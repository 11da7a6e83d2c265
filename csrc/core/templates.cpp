#include "core/templates.hpp"

#include <algorithm>
#include <array>
#include <cstdint>
#include <stdexcept>
#include <utility>

namespace pyplan {

namespace {

enum Op : int { F = 0, B = 1, W = 2 };

struct StageOp {
    int op;
    int mb;
};

struct Programs {
    bool ok = false;
    std::vector<std::vector<StageOp>> ops;     // per stage, in order
    std::vector<std::vector<int64_t>> steps;   // the unit-time step of each op
};

const std::vector<int>& members(const StageBlocks& s, int op) {
    return op == F ? s.forward : op == B ? s.backward : s.weight;
}

// Unit-time 1F1B of `num` stages, F flowing down and B back up: at each step a stage runs a
// backward as soon as one is ready, otherwise a forward while it holds fewer than num - s
// micro-batches (or limits[s], if fewer). Every stage decides from the counts before the step.
Programs one_f_one_b(int num, int n, const std::vector<int>& limits) {
    Programs p;
    p.ops.resize(num);
    p.steps.resize(num);
    std::vector<int> caps(num), f(num, 0), b(num, 0);
    for (int s = 0; s < num; ++s)
        caps[s] = limits.empty() ? num - s : std::min(num - s, limits[s]);
    int64_t remaining = int64_t{num} * n * 2;
    std::vector<StageOp> chosen(num);
    std::vector<char> runs(num);
    for (int64_t step = 0; remaining > 0; ++step) {
        int count = 0;
        for (int s = 0; s < num; ++s) {
            const int fs = f[s], bs = b[s];
            runs[s] = 0;
            if (bs < n && fs > bs && (s == num - 1 || b[s + 1] > bs)) {
                chosen[s] = {B, bs};
                runs[s] = 1;
            } else if (fs < n && (s == 0 || f[s - 1] > fs) && fs - bs < caps[s]) {
                chosen[s] = {F, fs};
                runs[s] = 1;
            }
            count += runs[s];
        }
        if (count == 0) return p;  // nothing can run now, so nothing ever will
        for (int s = 0; s < num; ++s) {
            if (!runs[s]) continue;
            ++(chosen[s].op == F ? f : b)[s];
            p.ops[s].push_back(chosen[s]);
            p.steps[s].push_back(step);
        }
        remaining -= count;
    }
    p.ok = true;
    return p;
}

// Start step of each stage's ops when every op takes one step and runs once its inputs (F of
// the stage before, B of the stage after, the stage's own F or B) are done.
bool unit_times(Programs& p) {
    const int num = static_cast<int>(p.ops.size());
    int mbs = 0;
    for (const auto& ops : p.ops)
        for (const StageOp& x : ops) mbs = std::max(mbs, x.mb + 1);
    // end[op][s * mbs + m]: the step after (op, m) of stage s ran, -1 before
    std::vector<std::vector<int64_t>> end(3, std::vector<int64_t>(size_t(num) * mbs, -1));
    auto at = [&](int op, int s, int m) -> int64_t& { return end[op][size_t(s) * mbs + m]; };
    std::vector<size_t> pos(num, 0);
    std::vector<int64_t> free(num, 0);
    for (bool progress = true; progress;) {
        progress = false;
        for (int s = 0; s < num; ++s) {
            const auto& ops = p.ops[s];
            while (pos[s] < ops.size()) {  // as far as this stage's inputs allow
                const auto [op, m] = ops[pos[s]];
                int64_t start = free[s];
                bool ready = true;
                auto need = [&](int dep_op, int dep_s) {
                    const int64_t e = at(dep_op, dep_s, m);
                    if (e < 0) ready = false;
                    start = std::max(start, e);
                };
                if (op == F) {
                    if (s > 0) need(F, s - 1);
                } else if (op == B) {
                    need(F, s);
                    if (s < num - 1) need(B, s + 1);
                } else {
                    need(B, s);
                }
                if (!ready) break;
                at(op, s, m) = free[s] = start + 1;
                ++pos[s];
                progress = true;
            }
        }
    }
    p.steps.assign(num, {});
    for (int s = 0; s < num; ++s) {
        if (pos[s] < p.ops[s].size()) return false;  // an op never became ready
        for (const StageOp& x : p.ops[s]) p.steps[s].push_back(at(x.op, s, x.mb) - 1);
    }
    return true;
}

struct Keyed {
    int64_t key;
    Instance inst;
};

// Real instances keyed by the step of their stage op, then chain (tag), then position inside
// the stage: sorting the keys gives one global order every device agrees with. Keys are even
// so that a glued W pass can take key + 1, right after its B.
void add_keys(const Graph& g, const Programs& p, const std::vector<StageBlocks>& stages,
              int tag, std::vector<Keyed>& out) {
    const int64_t width = g.num_blocks() + 1;  // positions inside a stage
    for (size_t s = 0; s < p.ops.size(); ++s)
        for (size_t i = 0; i < p.ops[s].size(); ++i) {
            const StageOp& x = p.ops[s][i];
            const auto& blocks = members(stages[s], x.op);
            for (size_t pos = 0; pos < blocks.size(); ++pos)
                out.push_back({p.steps[s][i] * 4 * width + 2 * int64_t(pos) + 2 * tag * width,
                               {blocks[pos], x.mb}});
        }
}

DeviceOrders orders_from_keys(const Graph& g, std::vector<Keyed>& keyed) {
    std::stable_sort(keyed.begin(), keyed.end(),
                     [](const Keyed& a, const Keyed& b) { return a.key < b.key; });
    DeviceOrders orders(g.num_devices());
    for (const Keyed& k : keyed)
        for (int d : g.block(k.inst.block).devices) orders[d].push_back(k.inst);
    return orders;
}

void check_stages(const Graph& g, const std::vector<StageBlocks>& stages) {
    for (const StageBlocks& s : stages)
        for (const auto* list : {&s.forward, &s.backward, &s.weight})
            for (int b : *list)
                if (b < 0 || b >= g.num_blocks()) throw std::out_of_range("no such block");
}

}  // namespace

TemplateOrders one_f_one_b_orders(const Graph& g,
                                  const std::vector<std::vector<StageBlocks>>& chains, int n,
                                  const std::vector<int>& limits,
                                  const std::vector<int>& weight_after) {
    if (chains.size() > 2) throw std::invalid_argument("one chain (1F1B) or two (Chimera)");
    if (!weight_after.empty() && static_cast<int>(weight_after.size()) != g.num_blocks())
        throw std::invalid_argument("weight_after needs one entry per block");
    TemplateOrders out;
    std::vector<Keyed> keyed;
    for (size_t tag = 0; tag < chains.size(); ++tag) {
        const auto& stages = chains[tag];
        check_stages(g, stages);
        const int num = static_cast<int>(stages.size());
        if (!limits.empty() && static_cast<int>(limits.size()) != num)
            throw std::invalid_argument("one limit per stage");
        Programs p = one_f_one_b(num, n, tag == 0 ? limits : std::vector<int>{});
        if (!p.ok) return out;
        add_keys(g, p, stages, static_cast<int>(tag), keyed);
    }
    if (!weight_after.empty()) {  // a split backward's two halves back to back
        std::vector<Keyed> glued;
        glued.reserve(keyed.size() * 2);
        for (const Keyed& k : keyed) {
            glued.push_back(k);
            const int w = weight_after[k.inst.block];
            if (w >= 0) {
                if (w >= g.num_blocks()) throw std::out_of_range("no such block");
                glued.push_back({k.key + 1, {w, k.inst.mb}});
            }
        }
        keyed.swap(glued);
    }
    out.orders = orders_from_keys(g, keyed);
    out.ok = true;
    return out;
}

TemplateOrders zb_h1_orders(const Graph& g, const std::vector<StageBlocks>& stages, int n) {
    check_stages(g, stages);
    const int num = static_cast<int>(stages.size());
    TemplateOrders out;
    Programs base = one_f_one_b(num, n, {});
    if (!base.ok) return out;
    // W(m) right after B(m + s): the W passes deferred this way fill the cooldown bubbles.
    Programs p;
    p.ops.resize(num);
    for (int s = 0; s < num; ++s) {
        for (const StageOp& x : base.ops[s]) {
            p.ops[s].push_back(x);
            if (x.op == B && x.mb - s >= 0) p.ops[s].push_back({W, x.mb - s});
        }
        for (int m = std::max(0, n - s); m < n; ++m) p.ops[s].push_back({W, m});
    }
    if (!unit_times(p)) return out;
    std::vector<Keyed> keyed;
    add_keys(g, p, stages, 0, keyed);
    out.orders = orders_from_keys(g, keyed);
    out.ok = true;
    return out;
}

TemplateOrders greedy_orders(const Graph& g, const std::vector<StageBlocks>& stages,
                             const std::vector<int>& stage_device, int n, bool split,
                             const std::vector<int>& in_flight,
                             const std::vector<int>& program_device) {
    check_stages(g, stages);
    const int S = static_cast<int>(stage_device.size());
    if (S == 0 || static_cast<int>(stages.size()) != S)
        throw std::invalid_argument("one device per stage");
    const int D = *std::max_element(stage_device.begin(), stage_device.end()) + 1;
    if (*std::min_element(stage_device.begin(), stage_device.end()) < 0 ||
        static_cast<int>(in_flight.size()) < D || static_cast<int>(program_device.size()) < D)
        throw std::invalid_argument("in_flight and program_device need one entry per device");
    for (int d : program_device)
        if (d < 0 || d >= g.num_devices()) throw std::out_of_range("no such device");
    // done(op, s, m) <=> m < count[op][s]: each op of a stage runs its micro-batches in order
    std::vector<std::vector<int>> count(3, std::vector<int>(S, 0));
    std::vector<std::vector<int>> on(D);
    for (int s = S - 1; s >= 0; --s) on[stage_device[s]].push_back(s);  // latest stage first
    std::vector<int64_t> held(D, 0);
    // Where every forward allocates memory, "in flight" is memory: a device holds at most
    // in_flight[d] of its largest forward's worth, what B frees and what W frees (a split
    // backward may keep the GEMMs' inputs until W) taken off as they run; W passes deferred
    // without end would otherwise pile up what they keep. Without memory, it counts forwards
    // not yet backward.
    std::vector<std::array<int64_t, 3>> delta(S, {0, 0, 0});
    bool by_memory = true;
    for (int s = 0; s < S; ++s) {
        for (int op : {F, B, W})
            for (int b : members(stages[s], op)) delta[s][op] += g.block(b).memory;
        by_memory = by_memory && delta[s][F] > 0;
    }
    std::vector<int64_t> bytes(D, 0), unit(D, 0);  // unit: the device's largest forward
    for (int s = 0; s < S; ++s)
        unit[stage_device[s]] = std::max(unit[stage_device[s]], delta[s][F]);
    // A forward of an earlier stage leaves room for one of each later stage on its device:
    // those drain the device (their backward frees what the earlier forwards hold).
    std::vector<int64_t> later(S, 0);
    for (int s = 0; s < S; ++s)
        for (int t = s + 1; t < S; ++t)
            if (stage_device[t] == stage_device[s]) later[s] += delta[t][F];
    std::vector<std::vector<std::pair<int, int>>> programs(D);  // (op, stage)
    const int64_t total = int64_t{S} * n * (split ? 3 : 2);
    int64_t done = 0;
    struct Choice {
        int d, op, s;
    };
    std::vector<Choice> chosen;
    TemplateOrders out;
    bool finished = false;
    for (int64_t round = 0; round < 4 * total + 10; ++round) {
        if (done == total) {
            finished = true;
            break;
        }
        chosen.clear();
        for (int d = 0; d < D; ++d) {
            for (int op : {B, F, W}) {
                int pick = -1;
                for (int s : on[d]) {
                    const int m = count[op][s];
                    if (m >= n) continue;
                    bool ready = false;
                    if (op == F)
                        ready = (s == 0 || count[F][s - 1] > m) &&
                                (by_memory ? bytes[d] + delta[s][F] + later[s] <=
                                                 in_flight[d] * unit[d]
                                           : held[d] < in_flight[d]);
                    else if (op == B)
                        ready = count[F][s] > m && (s == S - 1 || count[B][s + 1] > m);
                    else
                        ready = split && count[B][s] > m;
                    if (!ready) continue;
                    // W: the stage with the fewest W done (the first of them); F and B: the
                    // first ready
                    if (pick < 0 || (op == W && count[W][s] < count[W][pick])) pick = s;
                    if (op != W) break;
                }
                if (pick >= 0) {
                    chosen.push_back({d, op, pick});
                    break;
                }
            }
        }
        if (chosen.empty()) break;
        for (const Choice& c : chosen) {
            programs[c.d].push_back({c.op, c.s});
            ++count[c.op][c.s];
            held[c.d] += c.op == F ? 1 : c.op == B ? -1 : 0;
            bytes[c.d] += delta[c.s][c.op];
            ++done;
        }
    }
    if (!finished) return out;
    out.orders.assign(g.num_devices(), {});
    std::vector<std::vector<int>> next(3, std::vector<int>(S, 0));  // micro-batch of each op
    for (int p = 0; p < D; ++p) {
        auto& order = out.orders[program_device[p]];
        for (auto [op, s] : programs[p]) {
            const int m = next[op][s]++;
            for (int b : members(stages[s], op)) order.push_back({b, m});
        }
    }
    out.ok = true;
    return out;
}

}  // namespace pyplan
