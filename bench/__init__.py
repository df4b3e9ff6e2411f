"""Benchmarks: kernels, offline throughput and the serving load generator."""
