"""gpuflow's work: pure modules and the thin Prefect task wrappers around them."""
