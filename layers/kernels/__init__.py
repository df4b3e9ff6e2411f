"""Kernels: each op in its own package, a plain-torch naive.py beside the Triton code."""
