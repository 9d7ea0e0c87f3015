/* tritonep packed launcher: one compiled kernel variant's parameters packed once, a launch fills the per-call slots.
 *
 * Spec and Python side: tritonep/runtime/packed_launch.py (its twin ``pack_twin`` gives the bytes ``fill`` must give).
 *
 * make(function, gx, gy, gz, num_warps, num_ctas, shared, coop, pdl, blob, offsets, kinds, dyn_offsets)
 *     -> capsule. ``blob``: the parameter storage with every static value already packed (bytes); ``offsets``: byte
 *     offset of each kernel parameter in it (a tuple of ints, in the kernel's order, the two scratch pointers last);
 *     ``kinds``: one byte per per-call value (see KIND below); ``dyn_offsets``: the byte offset each per-call value
 *     is stored at (a tuple of ints, ignored for kind 'x').
 * run(cap, stream, *dyn)                 launch on ``stream`` with the bound grid (gx < 0: none bound, use run_grid)
 * run_grid(cap, gx, gy, gz, stream, *dyn) launch with a per-call grid
 * fill(cap, *dyn) -> bytes               store the per-call values only and return the parameter storage (tests)
 *
 * KIND: 'p' device address (int >= 0 or None: 0; 8 bytes), 'b' int8, 'B' uint8, 'h' int16, 'H' uint16, 'i' int32,
 * 'I' uint32, 'l' int64, 'L' uint64, 'f' float32 (from a Python float or int), 'd' float64, 'x' not a kernel
 * parameter of this variant (a constexpr: its value is compiled in; the value is not read).
 *
 * The CUDA driver is opened with dlopen at the first launch (the module builds and packs without a GPU). The GIL is
 * held for the call, cuLaunchKernelEx included (it copies the parameters before it returns), so one capsule's
 * storage is filled by one thread at a time as long as the per-call values are ints, floats or None (a float-like
 * object's ``__float__`` could let another thread in); unlike Triton's launcher no other Python thread runs during
 * the driver call (tritonep's ranks are processes, never threads of one process). The launch mirrors Triton 3.6's generated launcher (grid X times num_ctas,
 * 32 * num_warps threads, the cooperative / PDL attributes, no launch on an empty grid, the current context made
 * the device's primary one when none is current).
 */
#include "cuda.h"
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define CAPSULE "tritonep.packed_launch"

typedef CUresult (*launch_ex_t)(const CUlaunchConfig *, CUfunction, void **, void **);
typedef CUresult (*ctx_get_t)(CUcontext *);
typedef CUresult (*dev_get_t)(CUdevice *, int);
typedef CUresult (*retain_t)(CUcontext *, CUdevice);
typedef CUresult (*ctx_set_t)(CUcontext);
typedef CUresult (*err_str_t)(CUresult, const char **);

static launch_ex_t p_launch = NULL;
static ctx_get_t p_ctx_get = NULL;
static dev_get_t p_dev_get = NULL;
static retain_t p_retain = NULL;
static ctx_set_t p_ctx_set = NULL;
static err_str_t p_err_str = NULL;

typedef struct {
  CUfunction function;
  int gx, gy, gz, num_warps, num_ctas, coop, pdl;
  unsigned int shared;
  int nparams, ndyn;
  char *buf;
  Py_ssize_t nbuf;
  void **params;
  char *kinds;
  Py_ssize_t *dyn_off;
} Packed;

static int load_driver(void) {
  if (p_launch != NULL) return 0;
  void *h = dlopen("libcuda.so.1", RTLD_LAZY);
  if (!h) {
    PyErr_SetString(PyExc_RuntimeError, "tritonep packed launch: cannot open libcuda.so.1");
    return -1;
  }
  p_ctx_get = (ctx_get_t)dlsym(h, "cuCtxGetCurrent");
  p_dev_get = (dev_get_t)dlsym(h, "cuDeviceGet");
  p_retain = (retain_t)dlsym(h, "cuDevicePrimaryCtxRetain");
  p_ctx_set = (ctx_set_t)dlsym(h, "cuCtxSetCurrent");
  p_err_str = (err_str_t)dlsym(h, "cuGetErrorString");
  launch_ex_t l = (launch_ex_t)dlsym(h, "cuLaunchKernelEx");
  if (!l || !p_ctx_get || !p_dev_get || !p_retain || !p_ctx_set || !p_err_str) {
    PyErr_SetString(PyExc_RuntimeError, "tritonep packed launch: libcuda.so.1 lacks cuLaunchKernelEx or a context call");
    return -1;
  }
  p_launch = l;
  return 0;
}

static int cuda_error(CUresult r, const char *what) {
  const char *s = NULL;
  if (p_err_str) p_err_str(r, &s);
  PyErr_Format(PyExc_RuntimeError, "tritonep packed launch: %s failed: %s (CUresult %d)", what, s ? s : "?", (int)r);
  return -1;
}

static void packed_free(PyObject *cap) {
  Packed *p = (Packed *)PyCapsule_GetPointer(cap, CAPSULE);
  if (!p) return;
  free(p->buf);
  free(p->params);
  free(p->kinds);
  free(p->dyn_off);
  free(p);
}

static Packed *get(PyObject *cap) { return (Packed *)PyCapsule_GetPointer(cap, CAPSULE); }

/* store one per-call value of kind k at dst; -1 with a Python error set on a bad value */
static int store(char k, PyObject *v, char *dst, Py_ssize_t j) {
  if (k == 'x') return 0;
  if (k == 'p') {
    uint64_t a = 0;
    if (v != Py_None) {
      if (!PyLong_Check(v)) {
        PyErr_Format(PyExc_TypeError, "per-call value %zd: a device address must be an int or None", j);
        return -1;
      }
      a = PyLong_AsUnsignedLongLong(v);
      if (PyErr_Occurred()) return -1;
    }
    memcpy(dst, &a, 8);
    return 0;
  }
  if (k == 'f' || k == 'd') {
    double d = PyFloat_AsDouble(v);
    if (d == -1.0 && PyErr_Occurred()) return -1;
    if (k == 'f') {
      float f = (float)d;
      memcpy(dst, &f, 4);
    } else {
      memcpy(dst, &d, 8);
    }
    return 0;
  }
  if (!PyLong_Check(v)) {
    PyErr_Format(PyExc_TypeError, "per-call value %zd: an integer parameter needs an int", j);
    return -1;
  }
  if (k == 'L') {
    uint64_t u = PyLong_AsUnsignedLongLong(v);
    if (PyErr_Occurred()) return -1;
    memcpy(dst, &u, 8);
    return 0;
  }
  long long x = PyLong_AsLongLong(v);
  if (x == -1 && PyErr_Occurred()) return -1;
  long long lo, hi;
  int size;
  switch (k) {
    case 'b': lo = INT8_MIN; hi = INT8_MAX; size = 1; break;
    case 'B': lo = 0; hi = UINT8_MAX; size = 1; break;
    case 'h': lo = INT16_MIN; hi = INT16_MAX; size = 2; break;
    case 'H': lo = 0; hi = UINT16_MAX; size = 2; break;
    case 'i': lo = INT32_MIN; hi = INT32_MAX; size = 4; break;
    case 'I': lo = 0; hi = UINT32_MAX; size = 4; break;
    case 'l': lo = INT64_MIN; hi = INT64_MAX; size = 8; break;
    default:
      PyErr_Format(PyExc_ValueError, "per-call value %zd: unknown kind %c", j, k);
      return -1;
  }
  if (x < lo || x > hi) {
    PyErr_Format(PyExc_OverflowError, "per-call value %zd: %lld does not fit kind %c", j, x, k);
    return -1;
  }
  if (size == 1) { int8_t t = (int8_t)x; memcpy(dst, &t, 1); }
  else if (size == 2) { int16_t t = (int16_t)x; memcpy(dst, &t, 2); }
  else if (size == 4) { int32_t t = (int32_t)x; memcpy(dst, &t, 4); }
  else { int64_t t = (int64_t)x; memcpy(dst, &t, 8); }
  return 0;
}

static int fill_values(Packed *p, PyObject *const *v, Py_ssize_t n) {
  if (n != p->ndyn) {
    PyErr_Format(PyExc_TypeError, "tritonep packed launch: %zd per-call values, bound for %d", n, p->ndyn);
    return -1;
  }
  for (Py_ssize_t j = 0; j < n; ++j)
    if (store(p->kinds[j], v[j], p->buf + p->dyn_off[j], j) < 0) return -1;
  return 0;
}

static PyObject *do_launch(Packed *p, int gx, int gy, int gz, PyObject *stream_obj) {
  uint64_t stream = PyLong_AsUnsignedLongLong(stream_obj);
  if (PyErr_Occurred()) return NULL;
  if ((long long)gx * gy * gz <= 0) Py_RETURN_NONE;  /* Triton launches nothing on an empty grid */
  if (load_driver() < 0) return NULL;
  CUcontext ctx = NULL;
  CUresult r = p_ctx_get(&ctx);
  if (r != CUDA_SUCCESS) { cuda_error(r, "cuCtxGetCurrent"); return NULL; }
  if (!ctx) {
    CUdevice dev;
    if ((r = p_dev_get(&dev, 0)) != CUDA_SUCCESS) { cuda_error(r, "cuDeviceGet"); return NULL; }
    if ((r = p_retain(&ctx, dev)) != CUDA_SUCCESS) { cuda_error(r, "cuDevicePrimaryCtxRetain"); return NULL; }
    if ((r = p_ctx_set(ctx)) != CUDA_SUCCESS) { cuda_error(r, "cuCtxSetCurrent"); return NULL; }
  }
  CUlaunchAttribute attrs[2];
  int na = 0;
  if (p->pdl) {
    attrs[na].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attrs[na].value.programmaticStreamSerializationAllowed = 1;
    ++na;
  }
  if (p->coop) {
    attrs[na].id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
    attrs[na].value.cooperative = 1;
    ++na;
  }
  CUlaunchConfig c;
  memset(&c, 0, sizeof(c));
  c.gridDimX = (unsigned)gx * (unsigned)p->num_ctas;
  c.gridDimY = (unsigned)gy;
  c.gridDimZ = (unsigned)gz;
  c.blockDimX = 32u * (unsigned)p->num_warps;
  c.blockDimY = 1;
  c.blockDimZ = 1;
  c.sharedMemBytes = p->shared;
  c.hStream = (CUstream)stream;
  c.attrs = attrs;
  c.numAttrs = (unsigned)na;
  r = p_launch(&c, p->function, p->params, NULL);
  if (r != CUDA_SUCCESS) { cuda_error(r, "cuLaunchKernelEx"); return NULL; }
  Py_RETURN_NONE;
}

static PyObject *py_make(PyObject *self, PyObject *args) {
  unsigned long long function;
  int gx, gy, gz, num_warps, num_ctas, coop, pdl;
  unsigned int shared;
  Py_buffer blob;
  PyObject *offsets, *dyn_offsets;
  Py_buffer kinds;
  if (!PyArg_ParseTuple(args, "KiiiiiIiiy*O!y*O!", &function, &gx, &gy, &gz, &num_warps, &num_ctas, &shared, &coop,
                        &pdl, &blob, &PyTuple_Type, &offsets, &kinds, &PyTuple_Type, &dyn_offsets))
    return NULL;
  Packed *p = (Packed *)calloc(1, sizeof(Packed));
  PyObject *cap = NULL;
  if (!p) { PyErr_NoMemory(); goto done; }
  if (num_ctas != 1) {
    PyErr_SetString(PyExc_ValueError, "tritonep packed launch: num_ctas must be 1 (clusters take Triton's launcher)");
    goto fail;
  }
  if (num_warps <= 0) {
    PyErr_SetString(PyExc_ValueError, "tritonep packed launch: num_warps must be > 0");
    goto fail;
  }
  p->function = (CUfunction)(uintptr_t)function;
  p->gx = gx; p->gy = gy; p->gz = gz;
  p->num_warps = num_warps; p->num_ctas = num_ctas; p->coop = coop; p->pdl = pdl; p->shared = shared;
  p->nbuf = blob.len;
  p->buf = (char *)malloc(blob.len > 0 ? (size_t)blob.len : 1);
  p->nparams = (int)PyTuple_GET_SIZE(offsets);
  p->params = (void **)malloc(sizeof(void *) * (p->nparams > 0 ? p->nparams : 1));
  p->ndyn = (int)kinds.len;
  p->kinds = (char *)malloc(kinds.len > 0 ? (size_t)kinds.len : 1);
  p->dyn_off = (Py_ssize_t *)malloc(sizeof(Py_ssize_t) * (kinds.len > 0 ? kinds.len : 1));
  if (!p->buf || !p->params || !p->kinds || !p->dyn_off) { PyErr_NoMemory(); goto fail; }
  if (PyTuple_GET_SIZE(dyn_offsets) != kinds.len) {
    PyErr_SetString(PyExc_ValueError, "tritonep packed launch: one dyn offset per kind");
    goto fail;
  }
  memcpy(p->buf, blob.buf, (size_t)blob.len);
  memcpy(p->kinds, kinds.buf, (size_t)kinds.len);
  for (int i = 0; i < p->nparams; ++i) {
    Py_ssize_t o = PyLong_AsSsize_t(PyTuple_GET_ITEM(offsets, i));
    if (o == -1 && PyErr_Occurred()) goto fail;
    if (o < 0 || o > blob.len - 8) { /* every slot holds 8 bytes (packed_launch.layout) */
      PyErr_Format(PyExc_ValueError, "tritonep packed launch: parameter %d offset %zd outside the %zd-byte blob", i, o,
                   blob.len);
      goto fail;
    }
    p->params[i] = p->buf + o;
  }
  for (Py_ssize_t j = 0; j < kinds.len; ++j) {
    char k = p->kinds[j];
    Py_ssize_t size = (k == 'b' || k == 'B') ? 1 : (k == 'h' || k == 'H') ? 2 : (k == 'i' || k == 'I' || k == 'f') ? 4
                      : (k == 'x') ? 0 : 8;
    if (!strchr("pbBhHiIlLfdx", k)) {
      PyErr_Format(PyExc_ValueError, "tritonep packed launch: unknown kind %c", k);
      goto fail;
    }
    Py_ssize_t o = PyLong_AsSsize_t(PyTuple_GET_ITEM(dyn_offsets, j));
    if (o == -1 && PyErr_Occurred()) goto fail;
    if (k != 'x' && (o < 0 || o + size > blob.len)) {
      PyErr_Format(PyExc_ValueError, "tritonep packed launch: per-call value %zd offset %zd outside the blob", j, o);
      goto fail;
    }
    p->dyn_off[j] = o;
  }
  cap = PyCapsule_New(p, CAPSULE, packed_free);
  if (!cap) goto fail;
  goto done;
fail:
  if (p) { free(p->buf); free(p->params); free(p->kinds); free(p->dyn_off); free(p); }
  cap = NULL;
done:
  PyBuffer_Release(&blob);
  PyBuffer_Release(&kinds);
  return cap;
}

/* the capsule of a call with at least ``n`` arguments (NULL with a TypeError naming ``usage`` otherwise) */
static Packed *entry(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t n, const char *usage) {
  if (nargs < n) {
    PyErr_SetString(PyExc_TypeError, usage);
    return NULL;
  }
  return get(args[0]);
}

static PyObject *py_run(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  Packed *p = entry(args, nargs, 2, "run(cap, stream, *dyn)");
  if (!p) return NULL;
  if (p->gx < 0) {
    PyErr_SetString(PyExc_TypeError, "tritonep packed launch: bound without a grid: use run_grid");
    return NULL;
  }
  if (fill_values(p, args + 2, nargs - 2) < 0) return NULL;
  return do_launch(p, p->gx, p->gy, p->gz, args[1]);
}

static PyObject *py_run_grid(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  Packed *p = entry(args, nargs, 5, "run_grid(cap, gx, gy, gz, stream, *dyn)");
  if (!p) return NULL;
  int g[3];
  for (int i = 0; i < 3; ++i) {
    long v = PyLong_AsLong(args[1 + i]);
    if (v == -1 && PyErr_Occurred()) return NULL;
    if (v < 0 || v > INT32_MAX) {
      PyErr_Format(PyExc_ValueError, "tritonep packed launch: grid dimension %ld", v);
      return NULL;
    }
    g[i] = (int)v;
  }
  if (fill_values(p, args + 5, nargs - 5) < 0) return NULL;
  return do_launch(p, g[0], g[1], g[2], args[4]);
}

static PyObject *py_fill(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  Packed *p = entry(args, nargs, 1, "fill(cap, *dyn)");
  if (!p) return NULL;
  if (fill_values(p, args + 1, nargs - 1) < 0) return NULL;
  return PyBytes_FromStringAndSize(p->buf, p->nbuf);
}

static PyMethodDef methods[] = {
    {"make", py_make, METH_VARARGS, "make(function, gx, gy, gz, num_warps, num_ctas, shared, coop, pdl, blob, "
                                     "offsets, kinds, dyn_offsets) -> capsule"},
    {"run", (PyCFunction)(void (*)(void))py_run, METH_FASTCALL, "run(cap, stream, *dyn)"},
    {"run_grid", (PyCFunction)(void (*)(void))py_run_grid, METH_FASTCALL, "run_grid(cap, gx, gy, gz, stream, *dyn)"},
    {"fill", (PyCFunction)(void (*)(void))py_fill, METH_FASTCALL, "fill(cap, *dyn) -> bytes"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_tritonep_launch", NULL, -1, methods};

PyMODINIT_FUNC PyInit__tritonep_launch(void) { return PyModule_Create(&module); }
