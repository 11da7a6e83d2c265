// Registrars of the pyplan._core extension, one per area of the core.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "core/evaluate.hpp"
#include "core/repetend.hpp"

namespace py = pybind11;

// Per-device orders cross into Python as the opaque class _core.Orders (converted once); plain
// lists of (block, micro-batch) pairs are converted by hand where accepted.
PYBIND11_MAKE_OPAQUE(pyplan::DeviceOrders)

using PyOrders = std::vector<std::vector<std::pair<int, int>>>;

// Argument checks shared by the bindings (the core assumes valid input): ValueError otherwise.
void check_count(int64_t n, int64_t limit, const char* what);
// IndexError unless 0 <= i < size.
void check_index(int64_t i, int64_t size, const char* what);
// Micro-batch indices of a repetend: one per block, each in 0 .. kMaxRepetendMicroBatches - 1,
// none increasing along a dependency (a block's inputs come from the same micro-batch or a
// later one of the repetition).
void check_indices(const pyplan::Graph& g, const std::vector<int>& indices);
// A repetend of this graph: its sizes, and each device's order listing exactly its blocks.
void check_repetend(const pyplan::Graph& g, const pyplan::Repetend& r);
pyplan::DeviceOrders to_orders(const PyOrders& orders);
PyOrders from_orders(const pyplan::DeviceOrders& orders);

void register_graph(py::module_& m);
void register_evaluate(py::module_& m);
void register_repetend(py::module_& m);
void register_modulo(py::module_& m);
void register_phases(py::module_& m);
void register_templates(py::module_& m);
void register_exhaustive(py::module_& m);
