#include "bindings.hpp"
#include "core/exhaustive.hpp"

using namespace pyplan;

void register_exhaustive(py::module_& m) {
    m.def(
        "schedule_within",
        [](const Graph& g, int n, int64_t target, const std::vector<int64_t>& headroom,
           const std::vector<bool>& is_forward, int64_t sync_time, int64_t node_budget,
           const std::vector<std::pair<int, int>>& after) {
            check_count(n, kMaxMicroBatches, "the number of micro-batches");
            std::vector<char> forward(is_forward.begin(), is_forward.end());
            ExhaustiveResult r;
            {
                py::gil_scoped_release release;
                r = schedule_within(g, n, target, headroom, forward, sync_time, node_budget,
                                    after);
            }
            static const char* names[] = {"none", "found", "unknown"};
            return py::make_tuple(names[r.status], r.start, r.nodes);
        },
        py::arg("graph"), py::arg("num_micro_batches"), py::arg("makespan"),
        py::arg("headroom"), py::arg("is_forward"), py::arg("sync_time"),
        py::arg("node_budget"), py::arg("after") = std::vector<std::pair<int, int>>{},
        "Is there a schedule of the whole problem within the makespan? (\"none\" | \"found\" "
        "| \"unknown\", starts [mb * K + block] when found, nodes searched); see "
        "csrc/core/exhaustive.hpp.");
}
