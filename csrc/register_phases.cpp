#include "bindings.hpp"
#include "core/phases.hpp"

using namespace pyplan;

void register_phases(py::module_& m) {
    m.def(
        "list_schedule_phase",
        [](const Graph& g, const std::vector<std::pair<int, int>>& phase,
           const std::vector<int64_t>& start, const std::vector<int64_t>& free,
           int num_micro_batches, bool reverse) {
            check_count(num_micro_batches, kMaxMicroBatches, "the number of micro-batches");
            // Times far beyond any schedule would overflow once blocks are added to them
            // (-2^62 is "free from the start").
            const int64_t limit = int64_t{1} << 62;
            for (int64_t t : start)
                if (t < -limit || t > limit) throw std::invalid_argument("a start beyond 2^62");
            for (int64_t t : free)
                if (t < -limit || t > limit) throw std::invalid_argument("a free time beyond 2^62");
            std::vector<Instance> instances;
            instances.reserve(phase.size());
            for (auto [b, mb] : phase) instances.push_back({b, mb});
            DeviceOrders orders;
            {
                py::gil_scoped_release release;
                orders = list_schedule_phase(g, instances, start, free, num_micro_batches,
                                             reverse);
            }
            return from_orders(orders);
        },
        py::arg("graph"), py::arg("phase"), py::arg("start"), py::arg("free"),
        py::arg("num_micro_batches"), py::arg("reverse") = false,
        "Per-device orders of a phase list-scheduled against the rest of a schedule "
        "(see csrc/core/phases.hpp).");
}
