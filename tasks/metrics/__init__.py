"""Samples during a run (NVML + host), their summary and cost, and how they are shown."""
