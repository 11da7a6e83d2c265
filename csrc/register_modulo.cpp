#include <algorithm>

#include "bindings.hpp"
#include "core/modulo.hpp"

using namespace pyplan;

void register_modulo(py::module_& m) {
    py::class_<ModuloStats>(m, "ModuloStats")
        .def(py::init<>())
        .def_readonly("nodes", &ModuloStats::nodes)
        .def_readonly("periods_tried", &ModuloStats::periods_tried)
        .def_readonly("budget_exhausted", &ModuloStats::budget_exhausted)
        .def_readonly("work", &ModuloStats::work);
    m.def(
        "modulo_schedule",
        [](const Graph& g, int64_t period, int max_micro_batches, int64_t capacity,
           int64_t budget, double seconds, int64_t work_budget) {
            check_count(max_micro_batches, kMaxRepetendMicroBatches, "max_micro_batches");
            check_count(period, (int64_t{1} << 28) / g.num_devices(),
                        "period (its reservation table has devices x period cells)");
            ModuloStats stats;
            Repetend r;
            {
                py::gil_scoped_release release;
                r = modulo_schedule(g, period, max_micro_batches, capacity, budget, stats,
                                    seconds, work_budget);
            }
            return py::make_tuple(r, stats);
        },
        py::arg("graph"), py::arg("period"), py::arg("max_micro_batches"),
        py::arg("memory_capacity") = -1, py::arg("node_budget") = 200000,
        py::arg("seconds") = 0.0, py::arg("work_budget") = 0);
    m.def(
        "repetend_from_starts",
        [](const Graph& g, const std::vector<int64_t>& start, int64_t period) {
            // Starts become lags (start / period) and so repetend indices: bound both.
            check_count(period, kMaxTime, "period");
            if (period == 0) throw std::invalid_argument("the period must be positive");
            const int64_t limit = int64_t{1} << 61;
            for (int64_t t : start)
                if (t < -limit || t > limit) throw std::invalid_argument("a start beyond 2^61");
            if (!start.empty()) {
                auto [low, high] = std::minmax_element(start.begin(), start.end());
                if ((*high - *low) / period >= kMaxRepetendMicroBatches)
                    throw std::invalid_argument("the starts span more than " +
                                                std::to_string(kMaxRepetendMicroBatches) +
                                                " periods");
            }
            return repetend_from_starts(g, start, period);
        },
        py::arg("graph"), py::arg("start"), py::arg("period"));
}
