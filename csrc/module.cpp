// pyplan._core: the scheduling core. This file only creates the module and calls the registrars.
#include "bindings.hpp"

PYBIND11_MODULE(_core, m) {
    m.doc() = "pyplan's C++ scheduling core: graphs, schedule evaluation, repetends";
    register_graph(m);
    register_evaluate(m);
    register_repetend(m);
    register_modulo(m);
    register_phases(m);
    register_templates(m);
    register_exhaustive(m);
}
