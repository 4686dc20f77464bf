"""What a spec's `placement:` holds on EC2 (read by the backend and its catalog)."""

from __future__ import annotations

from typing import Literal

from gpuflow.tasks.backends.instances.placement import Ask, InstancePlacement


class Ec2Placement(InstancePlacement):
    """placement: on EC2: the market instances are rented on."""

    backend: Literal["ec2"] = "ec2"


class Ec2Ask(Ask):
    """What EC2 is asked for a run's instances (see Ask)."""
