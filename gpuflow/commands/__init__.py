"""The `gpuflow` command's groups: each module adds its commands to the parser and holds
what they do. gpuflow.cli puts them together."""
