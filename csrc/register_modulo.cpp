#include <pybind11/stl.h>

#include "bindings.hpp"

void register_modulo(py::module_&) {}
