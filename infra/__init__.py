"""Tooling that is not part of the trainguard package: benchmarks and the like."""
