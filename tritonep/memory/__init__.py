"""Symmetric memory: region layout, ``required_bytes``, CUDA and CPU symmetric heaps, pointer tables, and the
barrier every backend of a group supports (:func:`group_barrier`)."""

from .collectives import group_barrier, uses_nccl
from .heap import (CpuHeap, CudaHeap, SymmetricBuffer, SymmetricHeap, get_heap, install_cpu_heap,
                   installed_cpu_heap)
from .layout import ALIGN, Layout, Region, layout, required_bytes

__all__ = ["ALIGN", "Region", "Layout", "layout", "required_bytes", "SymmetricBuffer", "SymmetricHeap", "CpuHeap",
           "CudaHeap", "get_heap", "install_cpu_heap", "installed_cpu_heap", "group_barrier", "uses_nccl"]
