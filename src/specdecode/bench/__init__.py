"""Benchmarks: workloads, peers (HF transformers), side-by-side runs and reports."""
