"""Triton kernels with their torch references (paged attention, KV-cache writes).

The oracle runner needs no kernels; the model runner that uses them arrives with the real
model (see the project's issues). The package exists now so that its place is fixed.
"""
