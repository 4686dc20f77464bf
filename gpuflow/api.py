"""gpuflow's Python API: GPU jobs from a Prefect user's own flows."""
