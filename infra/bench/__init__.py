"""Benchmarks: each module prints measured figures; none of them asserts a time."""
