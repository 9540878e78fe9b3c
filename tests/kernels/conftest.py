"""Kernel tests run the Triton kernels under the interpreter, on the CPU.

TRITON_INTERPRET must be in the environment before triton is first imported, and this
conftest is loaded before any kernel test module imports it. The variable holds for the whole
process, so where CUDA is present it is left alone (the real model's CUDA runs must not be
interpreted) and the interpreted kernel tests skip: benchmarks/gpu_check.py covers the kernels
on hardware.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
