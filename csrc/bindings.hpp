// Registrars of the pyplan._core extension, one per area of the core.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "core/evaluate.hpp"

namespace py = pybind11;

// Per-device orders cross into Python as the opaque class _core.Orders (converted once); plain
// lists of (block, micro-batch) pairs are converted by hand where accepted.
PYBIND11_MAKE_OPAQUE(pyplan::DeviceOrders)

using PyOrders = std::vector<std::vector<std::pair<int, int>>>;
pyplan::DeviceOrders to_orders(const PyOrders& orders);
PyOrders from_orders(const pyplan::DeviceOrders& orders);

void register_graph(py::module_& m);
void register_evaluate(py::module_& m);
void register_repetend(py::module_& m);
void register_modulo(py::module_& m);
