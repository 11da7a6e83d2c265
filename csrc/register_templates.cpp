#include <tuple>

#include "bindings.hpp"
#include "core/templates.hpp"

using namespace pyplan;

namespace {

// A stage as Python gives it: (forward blocks, backward blocks, weight blocks).
using PyStage = std::tuple<std::vector<int>, std::vector<int>, std::vector<int>>;

std::vector<StageBlocks> to_stages(const std::vector<PyStage>& stages) {
    std::vector<StageBlocks> out;
    out.reserve(stages.size());
    for (const auto& [f, b, w] : stages) out.push_back({f, b, w});
    return out;
}

// The orders as lists of (block, micro-batch) pairs, or None when the template's program
// cannot make progress on this placement.
py::object result(const TemplateOrders& t) {
    if (!t.ok) return py::none();
    return py::cast(from_orders(t.orders));
}

}  // namespace

void register_templates(py::module_& m) {
    m.def(
        "one_f_one_b_orders",
        [](const Graph& g, const std::vector<std::vector<PyStage>>& chains, int n,
           const std::vector<int>& limits, const std::vector<int>& weight_after) {
            check_count(n, kMaxMicroBatches, "the number of micro-batches");
            std::vector<std::vector<StageBlocks>> converted;
            for (const auto& chain : chains) converted.push_back(to_stages(chain));
            TemplateOrders t;
            {
                py::gil_scoped_release release;
                t = one_f_one_b_orders(g, converted, n, limits, weight_after);
            }
            return result(t);
        },
        py::arg("graph"), py::arg("chains"), py::arg("num_micro_batches"),
        py::arg("limits") = std::vector<int>{}, py::arg("weight_after") = std::vector<int>{},
        "1F1B (one chain of stages) or Chimera (two) as per-device orders, or None "
        "(see csrc/core/templates.hpp).");
    m.def(
        "zb_h1_orders",
        [](const Graph& g, const std::vector<PyStage>& stages, int n) {
            check_count(n, kMaxMicroBatches, "the number of micro-batches");
            auto converted = to_stages(stages);
            TemplateOrders t;
            {
                py::gil_scoped_release release;
                t = zb_h1_orders(g, converted, n);
            }
            return result(t);
        },
        py::arg("graph"), py::arg("stages"), py::arg("num_micro_batches"),
        "ZB-H1 as per-device orders, or None (see csrc/core/templates.hpp).");
    m.def(
        "greedy_orders",
        [](const Graph& g, const std::vector<PyStage>& stages,
           const std::vector<int>& stage_device, int n, bool split,
           const std::vector<int>& in_flight, const std::vector<int>& program_device) {
            check_count(n, kMaxMicroBatches, "the number of micro-batches");
            auto converted = to_stages(stages);
            TemplateOrders t;
            {
                py::gil_scoped_release release;
                t = greedy_orders(g, converted, stage_device, n, split, in_flight,
                                  program_device);
            }
            return result(t);
        },
        py::arg("graph"), py::arg("stages"), py::arg("stage_device"),
        py::arg("num_micro_batches"), py::arg("split"), py::arg("in_flight"),
        py::arg("program_device"),
        "Unit-time list scheduling of a chain of stages (ZB-H2, ZB-V) as per-device orders, "
        "or None (see csrc/core/templates.hpp).");
}
