// Sequence packing (filled in by the packing issue).
#include <pybind11/pybind11.h>

namespace py = pybind11;

void register_packing(py::module_& m) { m.attr("ABI_VERSION") = 1; }
