#include "bindings.hpp"
#include "core/evaluate.hpp"

using namespace pyplan;

void check_count(int64_t n, int64_t limit, const char* what) {
    if (n < 0 || n > limit)
        throw std::invalid_argument(std::string(what) + " must lie in 0 .. " +
                                    std::to_string(limit) + ", got " + std::to_string(n));
}

void check_index(int64_t i, int64_t size, const char* what) {
    if (i < 0 || i >= size)
        throw std::out_of_range(std::string(what) + " " + std::to_string(i) +
                                " out of range 0 .. " + std::to_string(size - 1));
}

void check_indices(const Graph& g, const std::vector<int>& indices) {
    if (static_cast<int>(indices.size()) != g.num_blocks())
        throw std::invalid_argument("need one micro-batch index per block");
    for (int i : indices) check_count(i, kMaxRepetendMicroBatches - 1, "a repetend index");
    for (const Edge& e : g.edges())
        if (indices[e.to] > indices[e.from])
            throw std::invalid_argument("indices must not increase along a dependency (" +
                                        g.block(e.from).name + " -> " + g.block(e.to).name +
                                        ")");
}

void check_repetend(const Graph& g, const Repetend& r) {
    const int k = g.num_blocks();
    if (static_cast<int>(r.indices.size()) != k ||
        static_cast<int>(r.orders.size()) != g.num_devices() ||
        (r.feasible && static_cast<int>(r.offsets.size()) != k))
        throw std::invalid_argument("the repetend belongs to another graph");
    for (int i : r.indices) check_count(i, kMaxRepetendMicroBatches - 1, "a repetend index");
    // Each device's order lists exactly the device's blocks, once each (a repetend of another
    // graph with as many blocks and devices would index blocks that are not there).
    std::vector<int> seen(k, -1);
    for (int d = 0; d < g.num_devices(); ++d) {
        const auto& order = r.orders[d];
        bool ok = order.size() == g.blocks_on(d).size();
        for (int b : order) {
            if (!ok) break;
            ok = b >= 0 && b < k && seen[b] != d;
            if (ok) seen[b] = d;
        }
        for (int b : g.blocks_on(d)) ok = ok && seen[b] == d;
        if (!ok) throw std::invalid_argument("the repetend belongs to another graph");
    }
}

// Memory levels are running sums: refuse orders whose sums could leave int64 (2^62 leaves room
// for the capacity comparisons).
static void check_memory_sums(const Graph& g, const DeviceOrders& orders,
                              const std::vector<int64_t>& initial) {
    const int64_t limit = int64_t{1} << 62;
    const int D = std::min<int>(g.num_devices(), static_cast<int>(orders.size()));
    for (int d = 0; d < D; ++d) {
        int64_t total = g.static_memory(d);
        if (d < static_cast<int>(initial.size())) {
            if (initial[d] > limit || initial[d] < -limit)
                throw std::invalid_argument("initial memory beyond +-2^62");
            total += initial[d] < 0 ? -initial[d] : initial[d];
        }
        for (const Instance& i : orders[d]) {
            if (i.block < 0 || i.block >= g.num_blocks()) continue;  // the core says which
            const int64_t m = g.block(i.block).memory;
            total += m < 0 ? -m : m;
            if (total > limit)
                throw std::invalid_argument("the memory of device " + std::to_string(d) +
                                            " could sum beyond 2^62 over these orders");
        }
    }
}

DeviceOrders to_orders(const PyOrders& orders) {
    DeviceOrders out(orders.size());
    for (size_t d = 0; d < orders.size(); ++d) {
        out[d].reserve(orders[d].size());
        for (auto [b, m] : orders[d]) {
            if (m > kMaxMicroBatches)
                throw std::invalid_argument("micro-batch index " + std::to_string(m) +
                                            " beyond 10^7");
            out[d].push_back({b, m});
        }
    }
    return out;
}

PyOrders from_orders(const DeviceOrders& orders) {
    PyOrders out(orders.size());
    for (size_t d = 0; d < orders.size(); ++d)
        for (const Instance& i : orders[d]) out[d].push_back({i.block, i.mb});
    return out;
}

void register_evaluate(py::module_& m) {
    py::class_<Evaluation>(m, "Evaluation")
        .def_readonly("ok", &Evaluation::ok)
        .def_readonly("reason", &Evaluation::reason)
        .def_readonly("num_micro_batches", &Evaluation::num_micro_batches)
        .def_readonly("start", &Evaluation::start)
        .def_readonly("makespan", &Evaluation::makespan)
        .def_readonly("busy", &Evaluation::busy)
        .def_readonly("peak_memory", &Evaluation::peak_memory)
        .def_readonly("bubble_rate", &Evaluation::bubble_rate)
        .def_readonly("scheduled_blocks", &Evaluation::scheduled_blocks)
        .def_property_readonly("deadlock_holds", [](const Evaluation& ev) {
            using Pair = std::pair<int, int>;
            std::vector<std::pair<Pair, Pair>> out;
            for (const auto& [holder, waiter] : ev.deadlock_holds)
                out.push_back({{holder.block, holder.mb}, {waiter.block, waiter.mb}});
            return out;
        });

    // Orders converted once, for callers that evaluate the same schedule repeatedly.
    py::class_<DeviceOrders>(m, "Orders")
        .def(py::init([](const PyOrders& orders) { return to_orders(orders); }), py::arg("orders"))
        .def("__len__", [](const DeviceOrders& o) { return o.size(); })
        .def("tolist", [](const DeviceOrders& o) { return from_orders(o); },
             "The orders as lists of (block, micro-batch) pairs.");

    // One evaluation for both forms of orders: prepared (_core.Orders) or plain lists.
    auto run = [](const Graph& g, const DeviceOrders& orders, int64_t memory_capacity,
                  std::vector<int64_t> initial_memory, int complete_micro_batches,
                  bool enforce_rules) {
        check_count(complete_micro_batches, kMaxMicroBatches, "complete_micro_batches");
        check_memory_sums(g, orders, initial_memory);
        EvalOptions opt{memory_capacity, std::move(initial_memory), complete_micro_batches,
                        enforce_rules};
        py::gil_scoped_release release;
        return evaluate(g, orders, opt);
    };
    m.def("evaluate", run, py::arg("graph"), py::arg("orders"), py::arg("memory_capacity") = -1,
          py::arg("initial_memory") = std::vector<int64_t>{},
          py::arg("complete_micro_batches") = 0, py::arg("enforce_rules") = true);
    m.def(
        "evaluate",
        [run](const Graph& g, const PyOrders& orders, int64_t memory_capacity,
              std::vector<int64_t> initial_memory, int complete_micro_batches,
              bool enforce_rules) {
            return run(g, to_orders(orders), memory_capacity, std::move(initial_memory),
                       complete_micro_batches, enforce_rules);
        },
        py::arg("graph"), py::arg("orders"), py::arg("memory_capacity") = -1,
        py::arg("initial_memory") = std::vector<int64_t>{},
        py::arg("complete_micro_batches") = 0, py::arg("enforce_rules") = true,
        "Earliest-start evaluation of per-device orders of (block, micro-batch).");
}
