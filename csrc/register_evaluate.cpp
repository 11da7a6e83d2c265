#include "bindings.hpp"
#include "core/evaluate.hpp"

using namespace pyplan;

void check_count(int64_t n, int64_t limit, const char* what) {
    if (n < 0 || n > limit)
        throw std::invalid_argument(std::string(what) + " must lie in 0 .. " +
                                    std::to_string(limit) + ", got " + std::to_string(n));
}

void check_repetend(const Graph& g, const Repetend& r) {
    if (static_cast<int>(r.indices.size()) != g.num_blocks() ||
        static_cast<int>(r.orders.size()) != g.num_devices())
        throw std::invalid_argument("the repetend belongs to another graph");
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
