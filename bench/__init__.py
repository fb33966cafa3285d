"""Benchmarks: the model ceiling (model_bench) and the service against it (service_bench)."""
