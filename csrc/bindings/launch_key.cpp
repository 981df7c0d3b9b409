// ctxfast._C.launch_key: the per-argument key of kernels/_launch.py's fast launch path, in
// C (the same classes as its Python fallback, kernels/_launch.py's arg_key, but as codes):
// a tensor -> 32 + 2 * scalar type + (address a multiple of 16); an int -> 16 if it is 1,
// else (2 | 4 | 8 for the i32 / i64 / u64 range) | (a multiple of 16); anything else ->
// (type, value). The codes are small ints, which CPython caches: a key allocates only its
// tuple. In Python the same loop cost ~0.5 us an argument on the dev machine, 20-30 us a
// launch, as much as the JIT path it replaces.
#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>

namespace ctxfast {
namespace {

PyObject* int_code(PyObject* x) {
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(x, &overflow);
  if (overflow == 0) {
    if (v == -1 && PyErr_Occurred()) return nullptr;
    if (v == 1) return PyLong_FromLong(16);
    const long aligned = (v & 15) == 0;
    const bool i32 = v >= -(1LL << 31) && v < (1LL << 31);
    return PyLong_FromLong((i32 ? 2 : 4) | aligned);
  }
  if (overflow > 0) {
    const unsigned long long u = PyLong_AsUnsignedLongLong(x);
    if (!(u == static_cast<unsigned long long>(-1) && PyErr_Occurred()))
      return PyLong_FromLong(8 | static_cast<long>((u & 15) == 0));
    PyErr_Clear();
  }
  return PyTuple_Pack(2, reinterpret_cast<PyObject*>(Py_TYPE(x)), x);  // beyond u64
}

// 1 for a tensor, 0 for anything else, -1 on a Python error. The exact type and the plain
// values are tested first; only what is left pays for an isinstance test (a subclass).
int is_tensor(PyObject* x) {
  if (THPVariable_CheckExact(x)) return 1;
  if (x == Py_None || PyBool_Check(x) || PyFloat_CheckExact(x) || PyUnicode_CheckExact(x) ||
      THPVariableClass == nullptr)
    return 0;
  return PyObject_IsInstance(x, THPVariableClass);
}

PyObject* tensor_code(const at::Tensor& t) {
  if (!t.has_storage()) {
    PyErr_SetString(PyExc_ValueError, "launch_key: a tensor argument has no storage");
    return nullptr;
  }
  const auto addr = reinterpret_cast<std::uintptr_t>(t.const_data_ptr());
  return PyLong_FromLong(32 + 2 * static_cast<long>(t.scalar_type()) +
                         static_cast<long>((addr & 15) == 0));
}

PyObject* launch_key(PyObject* /*self*/, PyObject* args) {
  if (!PyTuple_Check(args)) {
    PyErr_SetString(PyExc_TypeError, "launch_key: expected a tuple of launch arguments");
    return nullptr;
  }
  const Py_ssize_t n = PyTuple_GET_SIZE(args);
  PyObject* out = PyTuple_New(n);
  if (out == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* x = PyTuple_GET_ITEM(args, i);
    PyObject* k = nullptr;
    if (PyLong_CheckExact(x)) {  // most arguments: sizes and strides
      k = int_code(x);
    } else {
      const int tensor = is_tensor(x);
      if (tensor > 0) {
        k = tensor_code(THPVariable_Unpack(x));
      } else if (tensor == 0) {
        k = PyTuple_Pack(2, reinterpret_cast<PyObject*>(Py_TYPE(x)), x);
      }
    }
    if (k == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyTuple_SET_ITEM(out, i, k);
  }
  return out;
}

}  // namespace

PyMethodDef kLaunchKeyMethod = {
    "launch_key", launch_key, METH_O,
    "launch_key(args: tuple) -> tuple: the fast launch path's key of each argument "
    "(kernels/_launch.py)"};

}  // namespace ctxfast
