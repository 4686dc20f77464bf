"""Image references read as registries and engines read them."""

import pytest

from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.images import image_problem
from gpuflow.tasks.spec import load_spec


@pytest.mark.parametrize(
    "good",
    [
        "python:3.11-slim",
        "nvcr.io/nvidia/pytorch:24.01-py3",
        "localhost:5000/gpuflow/job:dev",
        "[::1]:5000/x",
        "ubuntu@sha256:" + "a" * 64,
        "ghcr.io/team/train:1.4@sha256:" + "0" * 64,
    ],
)
def test_references_registries_take_pass(good):
    assert image_problem(good) is None


@pytest.mark.parametrize(
    "bad, said",
    [
        ("", "the image is empty"),
        ("UPPER CASE:bad tag", "has a space in it"),
        ("Ubuntu", "its path must be lower case: 'ubuntu'?"),
        ("a:b:c", "is not an image reference;"),
        ("x@sha256:abc", "is not an image reference;"),
        ("a" * 300, "has a name over 255 characters"),
    ],
)
def test_a_bad_reference_is_one_phrase_with_its_fix(bad, said):
    assert said in image_problem(bad)


def test_a_kubernetes_placement_with_a_bad_image_is_refused():
    with pytest.raises(InvalidSpec) as refused:
        load_spec(
            {
                "job": {"kind": "command", "command": ["true"]},
                "placement": {"backend": "kubernetes", "image": "My Image"},
            }
        )
    assert "placement.image: 'My Image' has a space in it" in str(refused.value)
