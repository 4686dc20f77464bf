"""Everything checked before anything is provisioned: the placement, the backend's own
checks, what the job's kind needs matched with what the backend can do, the kind's checks,
and the secrets. One sentence per problem (InvalidSpec), naming the field and the fix."""

from __future__ import annotations

from gpuflow.tasks import extras, placement, secrets
from gpuflow.tasks.backends.registry import backend_class, get_backend
from gpuflow.tasks.contract import Capabilities, Needs
from gpuflow.tasks.errors import InvalidSpec, Unreachable
from gpuflow.tasks.host import resolve_program
from gpuflow.tasks.kinds.registry import kind_of
from gpuflow.tasks.metrics.cost import PriceTable
from gpuflow.tasks.runscope import once, recall, remember
from gpuflow.tasks.spec import Image, JobSpec
from gpuflow.tasks.storage import StorageError, check_writable


def check_spec(spec: JobSpec) -> tuple[JobSpec, PriceTable]:
    """Return the spec with its placement applied and the prices to use, once every check
    before provisioning passed; InvalidSpec otherwise. Checked once per run (the CLI's
    check is the flow's, tasks/runscope.py)."""
    checked = once(("checked", spec.model_dump_json()), lambda: _check_spec(spec))
    remember(("checked", checked[0].model_dump_json()), checked)  # a checked spec is checked
    return checked


def _check_spec(spec: JobSpec) -> tuple[JobSpec, PriceTable]:
    chosen = spec.placement.backend
    extras.require(backend_class(chosen).extra, "placement.backend", f"the {chosen} backend")
    spec, prices = placement.resolve(spec)
    backend = get_backend(spec.placement.backend, spec.placement)
    spec = kind_of(spec).sized(spec, backend.capabilities)
    spec, prices = backend.configure(spec, prices)
    spec = _fold_placement_image(spec)
    needs = kind_of(spec).needs(spec)
    backend.check(spec, needs)
    check_job(spec)
    secrets.resolve(spec.secret_env)  # a missing secret block fails here
    # last: an image is pulled only for a spec that passed every other check; one digest
    # per run (a pool's candidates: the first pinned, the others run that one)
    image = spec.image
    if image is not None and not image.digest and (known := recall(("image-digest", image.ref))):
        spec = spec.model_copy(update={"image": image.model_copy(update={"digest": known})})
    spec = backend.pin_image(spec, needs, _run_log)
    if spec.image is not None and spec.image.digest:
        remember(("image-digest", spec.image.ref), spec.image.digest)
    if spec.image is not None:
        kind_of(spec).check_in_image(spec, backend.capabilities)
    return spec, prices


def _run_log(line: str) -> None:
    from gpuflow.tasks.api_client import run_log

    run_log(line)


def _fold_placement_image(spec: JobSpec) -> JobSpec:
    """placement.image (Kubernetes', deprecated) read as image:, with one sentence."""
    older = getattr(spec.placement, "image", None)
    if not older:
        return spec
    _run_log(
        f"placement.image is deprecated and goes in the next release: write image: {older}"
        " at the top of the spec (the same image, on every backend that runs images)"
    )
    if spec.image is not None:
        return spec  # the same image (the spec refuses two that differ)
    return spec.model_copy(update={"image": Image(ref=older)})


def check_pool(spec: JobSpec) -> list[tuple[JobSpec, PriceTable]]:
    """Return, for each candidate of the spec's placement (one for a single placement),
    the spec placed there with its settings applied and its prices, once every candidate
    passed every check; InvalidSpec naming the candidate otherwise. Nothing is made."""
    if not spec.candidates:
        return [check_spec(spec)]
    checked, away = [], []
    for index, candidate in enumerate(spec.candidates):
        placed = spec.model_copy(update={"placement": candidate})
        try:
            checked.append(check_spec(placed))
        except Unreachable as exc:
            # a candidate whose service is away is one that cannot start now (its offers
            # say why), not a job that cannot run: another candidate may take it
            away.append(exc)
            checked.append(placement.resolve(placed))
        except InvalidSpec as exc:
            named = f"placement[{index}]"
            said = str(exc).replace("placement.", f"{named}.")
            if not said.startswith(named):
                said = f"{named} ({candidate.backend}): {said}"
            raise InvalidSpec(said) from None
    if len(away) == len(checked):
        raise away[0]
    return checked


def check_job(spec: JobSpec) -> None:
    """Raise InvalidSpec when the job itself (not the backend) cannot run as written."""
    where = get_backend(spec.placement.backend, spec.placement).capabilities
    kind = kind_of(spec)
    extras.require(kind.extra(spec, where), "job.kind", f"a {kind.name} job here")
    needs = kind.needs(spec)
    for field, url in [*needs.inputs.items(), ("storage.staging", spec.storage.staging or "")]:
        if url.startswith("s3://"):
            extras.require("aws", field, "an s3:// URL")
    match(spec, needs, where)
    try:
        if spec.storage.artifacts:
            check_writable(spec.storage.artifacts, None, "storage.artifacts")
        kind_of(spec).check(spec, where)
    except StorageError as exc:
        raise InvalidSpec(str(exc)) from None


def match(spec: JobSpec, needs: Needs, where: Capabilities) -> None:
    """Raise InvalidSpec when the backend cannot give what the job needs: files on this
    machine that its nodes cannot read, programs that are not on this machine's PATH."""
    if not where.local_files:
        for field, url in needs.inputs.items():
            if not url.startswith("s3://"):
                raise InvalidSpec(
                    f"{field}: {url} is on this machine, and on {spec.placement.backend} the job"
                    f" runs on {where.where} that cannot read it; upload it and give an s3:// URL."
                )
    if where.runs_here:  # in an image, the image is probed for the job's own programs
        wanted = needs.host_programs | ({} if spec.image else needs.programs)
        for field, program in wanted.items():
            if resolve_program(program) is None:
                python = program.startswith("python") and "/" not in program
                raise InvalidSpec(
                    f"{field}: {program!r} was not found on PATH or is not executable;"
                    " install it or give its full path"
                    + (
                        " (or job.python: gpuflow, the Python gpuflow runs from)."
                        if python
                        else "."
                    )
                )
