// Registrars of the pyplan._core extension, one per area of the core.
#pragma once

#include <pybind11/pybind11.h>

namespace py = pybind11;

void register_graph(py::module_& m);
void register_evaluate(py::module_& m);
void register_repetend(py::module_& m);
void register_modulo(py::module_& m);
