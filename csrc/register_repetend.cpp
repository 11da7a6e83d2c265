#include "bindings.hpp"
#include "core/repetend.hpp"

using namespace pyplan;


static PyOrders instances_to_py(const std::vector<Instance>& xs) {
    PyOrders out(1);
    for (const Instance& i : xs) out[0].push_back({i.block, i.mb});
    return out;
}

void register_repetend(py::module_& m) {
    py::class_<Repetend>(m, "Repetend")
        .def_readonly("indices", &Repetend::indices)
        .def_readonly("orders", &Repetend::orders)
        .def_readonly("feasible", &Repetend::feasible)
        .def_readonly("period", &Repetend::period)
        .def_readonly("offsets", &Repetend::offsets)
        .def_readonly("execution", &Repetend::execution)
        .def_readonly("wait", &Repetend::wait)
        .def_readonly("entry_memory", &Repetend::entry_memory)
        .def_readonly("peak_memory", &Repetend::peak_memory)
        .def_property_readonly("num_micro_batches", &Repetend::num_micro_batches)
        .def("bubble_rate",
             [](const Repetend& r, const Graph& g) {
                 check_repetend(g, r);
                 return r.bubble_rate(g);
             },
             py::arg("graph"));

    py::class_<RepetendEnumerator>(m, "RepetendEnumerator")
        .def(py::init([](const Graph& g, int num_mb, int64_t capacity, int64_t period_below) {
                 check_count(num_mb, kMaxRepetendMicroBatches, "num_micro_batches");
                 return new RepetendEnumerator(g, num_mb, capacity, period_below);
             }),
             py::arg("graph"),
             py::arg("num_micro_batches"), py::arg("memory_capacity") = -1,
             py::arg("period_below") = 0, py::keep_alive<1, 2>())
        .def("__iter__", [](RepetendEnumerator& e) -> RepetendEnumerator& { return e; })
        .def("__next__",
             [](RepetendEnumerator& e) {
                 std::vector<int> out;
                 if (!e.next(out)) throw py::stop_iteration();
                 return out;
             })
        .def(
            "batch",
            [](RepetendEnumerator& e, int size) {
                std::vector<std::vector<int>> out;
                py::gil_scoped_release release;
                std::vector<int> cand;
                while (static_cast<int>(out.size()) < size && e.next(cand)) out.push_back(cand);
                return out;
            },
            py::arg("size"))
        .def("set_period_below", &RepetendEnumerator::set_period_below)
        .def_property_readonly("visited_nodes", &RepetendEnumerator::visited_nodes);

    m.def("longest_paths", &longest_paths, py::arg("graph"));
    m.def(
        "repetend_bound",
        [](const Graph& g, const std::vector<int>& indices) {
            check_indices(g, indices);  // (an index rising along an edge divides by zero)
            return repetend_bound(g, indices, longest_paths(g));
        },
        py::arg("graph"), py::arg("indices"));
    auto check_range = [](const std::vector<int>& n) {
        for (int i : n) check_count(i, kMaxRepetendMicroBatches - 1, "a repetend index");
    };
    m.def(
        "evaluate_repetend",
        [check_range](const Graph& g, const std::vector<int>& indices,
                      const std::vector<std::vector<int>>& orders, int64_t min_period) {
            check_range(indices);
            py::gil_scoped_release release;
            return evaluate_repetend(g, indices, orders, min_period);
        },
        py::arg("graph"), py::arg("indices"), py::arg("orders"), py::arg("min_period") = 0);
    m.def(
        "list_schedule_repetend",
        [check_range](const Graph& g, const std::vector<int>& indices) {
            check_range(indices);
            py::gil_scoped_release release;
            return list_schedule_repetend(g, indices);
        },
        py::arg("graph"), py::arg("indices"));
    m.def("memory_fits", py::overload_cast<const Repetend&, int64_t>(&memory_fits),
          py::arg("repetend"), py::arg("capacity"));  // (r alone)
    m.def(
        "memory_fits",
        [](const Graph& g, const Repetend& r, int64_t capacity) {
            check_repetend(g, r);
            return memory_fits(g, r, capacity);
        },
        py::arg("graph"), py::arg("repetend"), py::arg("capacity"),
        "Whether the repetend's steady-state peaks fit the capacity and each device's own.");
    m.def(
        "warmup_blocks",
        [check_range](const std::vector<int>& n) {
            check_range(n);
            return instances_to_py(warmup_blocks(n))[0];
        },
        py::arg("indices"));
    m.def(
        "cooldown_blocks",
        [check_range](const std::vector<int>& n) {
            check_range(n);
            return instances_to_py(cooldown_blocks(n))[0];
        },
        py::arg("indices"));
    m.def(
        "periodic_orders",
        [](const Graph& g, const Repetend& r, int n) {
            check_repetend(g, r);
            check_count(n, kMaxMicroBatches, "num_micro_batches");
            return from_orders(periodic_orders(g, r, n));
        },
        py::arg("graph"), py::arg("repetend"), py::arg("num_micro_batches"));
    m.def(
        "extend",
        [](const Graph& g, const PyOrders& warmup, const Repetend& r, const PyOrders& cooldown,
           int n) {
            check_repetend(g, r);
            check_count(n, kMaxMicroBatches, "num_micro_batches");
            return extend(g, to_orders(warmup), r, to_orders(cooldown), n);
        },
        py::arg("graph"), py::arg("warmup"), py::arg("repetend"), py::arg("cooldown"),
        py::arg("num_micro_batches"),
        "The full orders, prepared for evaluate (Orders.tolist() gives them as lists).");

    py::class_<RepetendSearchStats>(m, "RepetendSearchStats")
        .def(py::init<>())
        .def_readonly("out_of_time", &RepetendSearchStats::out_of_time)
        .def_readonly("enumerated", &RepetendSearchStats::enumerated)
        .def_readonly("evaluated", &RepetendSearchStats::evaluated)
        .def_readonly("pruned_memory", &RepetendSearchStats::pruned_memory)
        .def_readonly("visited_nodes", &RepetendSearchStats::visited_nodes);
    m.def(
        "search_repetends",
        [](const Graph& g, int num_mb, int64_t capacity, int64_t best_period, int64_t target,
           int64_t max_candidates, double seconds) {
            check_count(num_mb, kMaxRepetendMicroBatches, "num_micro_batches");
            RepetendSearchStats stats;
            Repetend best;
            {
                py::gil_scoped_release release;
                best = search_repetends(g, num_mb, capacity, best_period, target, max_candidates,
                                        stats, seconds);
            }
            return py::make_tuple(best, stats);
        },
        py::arg("graph"), py::arg("num_micro_batches"), py::arg("memory_capacity") = -1,
        py::arg("best_period") = 0, py::arg("target") = 0, py::arg("max_candidates") = 0,
        py::arg("seconds") = 0.0);
    m.def(
        "periodic_makespan",
        [](const Graph& g, const Repetend& r, int n, int64_t capacity) {
            check_repetend(g, r);
            check_count(n, kMaxMicroBatches, "num_micro_batches");
            py::gil_scoped_release release;
            return periodic_makespan(g, r, n, capacity);
        },
        py::arg("graph"), py::arg("repetend"), py::arg("num_micro_batches"),
        py::arg("memory_capacity") = -1);
    m.def(
        "rank_repetends",
        [](const Graph& g, int num_mb, int64_t capacity, int64_t period, int n, int keep,
           int64_t max_candidates, double seconds) {
            check_count(num_mb, kMaxRepetendMicroBatches, "num_micro_batches_in_repetend");
            check_count(n, kMaxMicroBatches, "num_micro_batches");
            RepetendSearchStats stats;
            std::vector<Repetend> out;
            {
                py::gil_scoped_release release;
                out = rank_repetends(g, num_mb, capacity, period, n, keep, max_candidates, stats,
                                     seconds);
            }
            return py::make_tuple(out, stats);
        },
        py::arg("graph"), py::arg("num_micro_batches_in_repetend"), py::arg("memory_capacity"),
        py::arg("period"), py::arg("num_micro_batches"), py::arg("keep") = 4,
        py::arg("max_candidates") = 0, py::arg("seconds") = 0.0);
}
