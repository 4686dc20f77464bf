"""The platform around the flows: work-pool templates, job variables, deployments."""
