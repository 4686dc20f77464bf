"""What Prefect loads from gpuflow at start-up (its `prefect.collections` entry point): the
worker type gpuflow-kubernetes, where gpuflow[kubernetes] is installed. Without that extra
there is nothing to load, and nothing is said: a light install is not a broken one."""

from importlib.util import find_spec

if find_spec("prefect_kubernetes") is not None:
    from gpuflow.tasks.platform import k8s_worker  # noqa: F401  (registers the worker type)
