"""gpuflow's Prefect flows: orchestration only; the work lives in tasks/."""
