// PyInit for an extension that is a plain Python module: importing it loads the library and its
// TORCH_LIBRARY registrations; it has no Python-level functions. TORCH_EXTENSION_NAME is set by
// torch's build (setup.py).
#pragma once

#include <Python.h>

#define VLLM_DFLASH_CONCAT(a, b) a##b
#define VLLM_DFLASH_PYINIT(name) VLLM_DFLASH_CONCAT(PyInit_, name)
#define VLLM_DFLASH_STR(name) #name
#define VLLM_DFLASH_NAME(name) VLLM_DFLASH_STR(name)

PyMODINIT_FUNC VLLM_DFLASH_PYINIT(TORCH_EXTENSION_NAME)() {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, VLLM_DFLASH_NAME(TORCH_EXTENSION_NAME),
                               nullptr, 0, nullptr};
  return PyModule_Create(&module);
}
