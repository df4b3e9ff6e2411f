"""Kernels: each op in its own package, a plain-torch naive.py beside the Triton code.

First-use compiles. Triton compiles one variant per specialisation key, and by default an integer
argument's key records whether it equals 1 or is a multiple of 16, and a pointer's whether it is
16-byte aligned. Eager passes (prefill chunks, mixed decode + prefill) give kernels sequence
counts, block-table widths and index arrays that are views at any offset into a larger buffer, so
a warmed-up server still met new keys in the middle of serving (a compile of 0.5-1.7 s stalls
every running request; the worker logs each one, workers/compile_watch.py). Those arguments are
listed in the kernels' `do_not_specialize`: they are counts or the bases of scalar loads, where the
specialisation buys nothing. Strides of vector loads keep theirs (alignment lets loads vectorise).
"""
