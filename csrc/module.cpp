// fastgrpo._C: the pybind11 module. Each op lives in its own .cpp and registers itself here.
#include <pybind11/pybind11.h>

namespace py = pybind11;

void register_packing(py::module_& m);

PYBIND11_MODULE(_C, m) {
  m.doc() = "fastgrpo C++ extension: sequence packing and balancing";
  register_packing(m);
}
