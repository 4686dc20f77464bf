from prefect import flow

from gpuflow import CommandJob, JobSpec, Placement, Resources, gpu_job, gpu_jobs


@flow
def nightly():
    # one job, built from the same typed models the YAML uses
    hello = gpu_job(JobSpec(name="hello", job=CommandJob(command=["python", "-c", "print('hi')"])))
    print(
        hello.state,
        hello.exit_code,
        f"{hello.gpu_hours:.4f} GPU-h",
        f"${hello.cost_usd:.4f}",
        hello.artifacts_dir,
    )

    # a sweep: each job is its own subflow of this one; they run side by side as GPUs allow
    runs = gpu_jobs(
        [
            JobSpec(
                name=f"lr-{i}",
                job=CommandJob(command=["python", "-c", f"print('training with lr={lr}')"]),
                resources=Resources(gpus=0),  # 1 on a GPU machine
                placement=Placement(gpu_wait=3600),  # wait for a GPU another job holds
            )
            for i, lr in enumerate((0.1, 0.01, 0.001))
        ]
    )
    for run in runs:
        print(run.name, run.state, run.exit_code)


if __name__ == "__main__":
    nightly()
