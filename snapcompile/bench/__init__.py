"""Benchmarks: decode throughput, prefill time, KV memory and roofline, side by side in one run."""
