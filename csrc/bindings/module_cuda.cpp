// ctxfast._cuda: the Python module. Importing it registers the CUDA implementations of
// the ops whose schemas ctxfast._C defines (import ctxfast._C first).
#include <Python.h>

extern "C" {
PyMODINIT_FUNC PyInit__cuda(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_cuda", "ctxfast CUDA C++ kernels (ops under torch.ops.ctxfast)",
      -1, nullptr};
  return PyModule_Create(&module_def);
}
}
