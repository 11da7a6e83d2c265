#include "bindings.hpp"
#include "core/graph.hpp"

using namespace pyplan;

void register_graph(py::module_& m) {
    py::class_<Block>(m, "Block")
        .def(py::init([](std::string name, int64_t time, int64_t memory, std::vector<int> devices) {
                 return Block{std::move(name), time, memory, std::move(devices)};
             }),
             py::arg("name"), py::arg("time"), py::arg("memory"), py::arg("devices"))
        .def_readonly("name", &Block::name)
        .def_readonly("time", &Block::time)
        .def_readonly("memory", &Block::memory)
        .def_readonly("devices", &Block::devices);

    py::class_<OrderRule>(m, "OrderRule")
        .def(py::init([](int before, int before_shift, int after, int after_shift, int min_m) {
                 return OrderRule{before, before_shift, after, after_shift, min_m};
             }),
             py::arg("before"), py::arg("before_shift"), py::arg("after"),
             py::arg("after_shift"), py::arg("min_m") = 0)
        .def_readonly("before", &OrderRule::before)
        .def_readonly("before_shift", &OrderRule::before_shift)
        .def_readonly("after", &OrderRule::after)
        .def_readonly("after_shift", &OrderRule::after_shift)
        .def_readonly("min_m", &OrderRule::min_m);

    py::class_<Graph>(m, "Graph")
        .def(py::init([](int num_devices, std::vector<Block> blocks,
                         const std::vector<std::pair<int, int>>& edges,
                         std::vector<OrderRule> rules, std::vector<int64_t> static_memory,
                         const std::vector<int64_t>& delays, std::vector<int64_t> capacity) {
                 if (!delays.empty() && delays.size() != edges.size())
                     throw std::invalid_argument("delays needs one transfer time per edge");
                 std::vector<Edge> es;
                 es.reserve(edges.size());
                 for (size_t i = 0; i < edges.size(); ++i)
                     es.push_back({edges[i].first, edges[i].second,
                                   delays.empty() ? 0 : delays[i]});
                 return Graph(num_devices, std::move(blocks), std::move(es), std::move(rules),
                              std::move(static_memory), std::move(capacity));
             }),
             py::arg("num_devices"), py::arg("blocks"), py::arg("edges"),
             py::arg("rules") = std::vector<OrderRule>{},
             py::arg("static_memory") = std::vector<int64_t>{},
             py::arg("delays") = std::vector<int64_t>{},
             py::arg("capacity") = std::vector<int64_t>{})
        .def_property_readonly("capacity", [](const Graph& g) { return g.capacity(); })
        .def_property_readonly("static_memory",
                               [](const Graph& g) { return g.static_memory(); })
        .def_property_readonly("num_devices", &Graph::num_devices)
        .def_property_readonly("num_blocks", &Graph::num_blocks)
        .def_property_readonly("blocks", &Graph::blocks)
        .def_property_readonly("edges",
                               [](const Graph& g) {
                                   std::vector<std::pair<int, int>> out;
                                   for (const Edge& e : g.edges()) out.push_back({e.from, e.to});
                                   return out;
                               })
        .def_property_readonly("delays",
                               [](const Graph& g) {
                                   std::vector<int64_t> out;
                                   for (const Edge& e : g.edges()) out.push_back(e.delay);
                                   return out;
                               })
        .def_property_readonly("rules", &Graph::rules)
        // The core indexes without checking: every index from Python is checked here.
        .def("successors",
             [](const Graph& g, int b) {
                 check_index(b, g.num_blocks(), "block");
                 return g.successors(b);
             }, py::arg("block"))
        .def("predecessors",
             [](const Graph& g, int b) {
                 check_index(b, g.num_blocks(), "block");
                 return g.predecessors(b);
             }, py::arg("block"))
        .def("blocks_on",
             [](const Graph& g, int d) {
                 check_index(d, g.num_devices(), "device");
                 return g.blocks_on(d);
             }, py::arg("device"))
        .def("topological_order", &Graph::topological_order)
        .def("find_cycle", &Graph::find_cycle)
        .def("is_acyclic", &Graph::is_acyclic)
        .def("device_loads", &Graph::device_loads)
        .def("load_bound", &Graph::load_bound)
        .def("critical_path", &Graph::critical_path)
        .def("heads", &Graph::heads)
        .def("tails", &Graph::tails)
        .def("makespan_bound",
             [](const Graph& g, int n, int64_t capacity) {
                 check_count(n, kMaxMicroBatches, "num_micro_batches");
                 return g.makespan_bound(n, capacity);
             },
             py::arg("num_micro_batches"), py::arg("capacity") = -1)
        .def("period_bound", &Graph::period_bound, py::arg("capacity") = -1)
        .def("memory_time", &Graph::memory_time, py::arg("device"))
        .def("head_idle", &Graph::head_idle, py::arg("device"))
        .def("net_memory", &Graph::net_memory);
}
