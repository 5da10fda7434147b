"""Benchmarks: measured side by side with the raw store in the same run (see docs/benchmarks.md)."""
