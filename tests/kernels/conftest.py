"""Kernel tests run the Triton kernels under the interpreter, on the CPU.

TRITON_INTERPRET must be in the environment before triton is first imported, and this
conftest is loaded before any kernel test module imports it.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
