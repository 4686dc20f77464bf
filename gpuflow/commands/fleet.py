"""`gpuflow fleet apply | status | delete`: GPU servers that outlive a run (a GpuFleet
block). `apply` saves a fleet from its YAML (or takes a saved one), reaches every host over
SSH, puts this gpuflow there and checks it; the hosts that pass serve, each other one is
named with its reason. `status` asks each host what holds its GPUs now; `delete` removes
the block once no run holds a GPU of it."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from gpuflow import session
from gpuflow.commands.common import EXIT_FAILED, EXIT_OK, invalid

NAME_HELP = "a fleet's YAML file (its `name:`, `hosts:`, `ssh_key:` ...) or a saved fleet's name"


def add(commands: Any) -> list[tuple[str, str]]:
    parser = commands.add_parser(
        "fleet",
        description="GPU servers that outlive a run, shared by GPU between every gpuflow"
        " process that uses them (placement: {backend: fleet, fleet: NAME}).",
    )
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    apply = verbs.add_parser(
        "apply",
        description="Save the fleet (from YAML) and check every host: reach it over SSH (its"
        " host key checked), put this gpuflow there, check its Python, GPUs and disk.",
    )
    apply.add_argument("source", help=NAME_HELP)
    apply.add_argument("--json", action="store_true", help="print each host's check as JSON")
    apply.set_defaults(handler=lambda args: run(lambda: _apply(args.source, args.json)))
    status = verbs.add_parser(
        "status", description="Each host's GPUs and the runs holding them now."
    )
    status.add_argument("name", help="the fleet's name")
    status.add_argument("--json", action="store_true", help="print it as JSON")
    status.set_defaults(handler=lambda args: run(lambda: _status(args.name, args.json)))
    delete = verbs.add_parser(
        "delete", description="Remove the fleet's block (refused while a run holds its GPUs)."
    )
    delete.add_argument("name", help="the fleet's name")
    delete.set_defaults(handler=lambda args: run(lambda: _delete(args.name)))
    return [("fleet", "GPU servers that outlive a run: apply, status, delete")]


def run(body: Any) -> int:
    return session.with_api(lambda api: body())


def read_fleet(source: str) -> tuple[str, Any]:
    """Return the fleet's name and its GpuFleet: from a YAML file, or the block saved under
    `source`. InvalidSpec, one sentence per problem, for a bad one."""
    from pydantic import ValidationError

    from gpuflow.blocks.gpu_fleet import GpuFleet
    from gpuflow.tasks import yamlfile
    from gpuflow.tasks.backends.fleet.backend import fleet_block
    from gpuflow.tasks.errors import InvalidSpec

    path = Path(source)
    if not (path.suffix in (".yaml", ".yml", ".json") or path.is_file()):
        return source, fleet_block(source)
    data = yamlfile.read(path, "a fleet YAML or JSON file")
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        raise InvalidSpec(f"name: {path} names no fleet; add `name: lab` (the block's name).")
    name = data.pop("name")
    data.pop("checked", None)  # written by apply only
    try:
        return name, GpuFleet.model_validate(data)
    except ValidationError as exc:
        raise InvalidSpec(_said(exc)) from None


def _said(exc: Any) -> str:
    sentences = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"])
        text = str(error["msg"]).removeprefix("Value error, ")
        sentences.append(f"{where}: {text}" if where else text)
    return " ".join(s if s.endswith(".") else s + "." for s in sentences)


def _apply(source: str, as_json: bool) -> int:
    from gpuflow.tasks.backends.fleet.backend import secret_text
    from gpuflow.tasks.backends.fleet.hosts import check_host
    from gpuflow.tasks.errors import InvalidSpec

    try:
        name, fleet = read_fleet(source)
    except InvalidSpec as exc:
        return invalid(exc)
    if not fleet.hosts:
        return invalid(InvalidSpec(f"hosts: fleet {name!r} has no hosts; list at least one."))
    with ThreadPoolExecutor(max_workers=min(16, len(fleet.hosts))) as pool:
        checks = list(pool.map(lambda host: check_host(fleet, host, secret_text), fleet.hosts))
    fleet.checked = checks
    fleet.save(name, overwrite=True)
    if as_json:
        print(json.dumps([c.model_dump() for c in checks], indent=1))
    else:
        serving = [c for c in checks if c.ok]
        print(f"fleet {name}: {len(serving)} of {len(checks)} host(s) serve")
        for check in checks:
            if check.ok:
                products = ", ".join(check.products) or "no GPU"
                print(
                    f"  {check.host:16} serves: {check.gpus} x {products}, Python"
                    f" {check.python}, {check.cpus} CPUs, {check.disk_free_gib} GiB free"
                )
            else:
                print(f"  {check.host:16} kept out: {check.reason}")
    return EXIT_OK if any(c.ok for c in checks) else EXIT_FAILED


def _status(name: str, as_json: bool) -> int:
    from gpuflow.tasks.backends.fleet.backend import fleet_block, host_status
    from gpuflow.tasks.errors import InvalidSpec

    try:
        fleet = fleet_block(name)
    except InvalidSpec as exc:
        return invalid(exc)
    with ThreadPoolExecutor(max_workers=min(16, max(1, len(fleet.hosts)))) as pool:
        found = list(pool.map(lambda host: host_status(fleet, host), fleet.hosts))
    rows = [{"host": host.label, **said} for host, said in zip(fleet.hosts, found, strict=True)]
    if as_json:
        print(json.dumps(rows, indent=1))
        return EXIT_OK
    print(f"fleet {name}: {len(rows)} host(s)")
    for row in rows:
        if "error" in row:
            print(f"  {row['host']:16} unreachable: {row['error']}")
            continue
        runs = row["runs"]
        print(f"  {row['host']:16} {row['free']} of {row['gpus']} GPU(s) free; {len(runs)} run(s)")
        for held in runs:
            alive = "held" if held.get("server_alive") else "lease lapsed, to be reaped"
            print(f"    {held['name']}: GPUs {held['gpus']} ({alive})")
    return EXIT_OK


def _delete(name: str) -> int:
    from gpuflow.tasks.backends.fleet.backend import fleet_block, host_status
    from gpuflow.tasks.errors import InvalidSpec

    try:
        fleet = fleet_block(name)
    except InvalidSpec as exc:
        return invalid(exc)
    busy = []
    for host in fleet.hosts:
        said = host_status(fleet, host)
        busy += [f"{host.label}: {run['name']}" for run in said.get("runs", [])]
    if busy:
        session.fail(
            f"fleet {name!r} still has runs holding its GPUs ({'; '.join(busy)}); cancel"
            " them (`gpuflow cancel`) or wait for them to end, then delete it."
        )
        return EXIT_FAILED
    from prefect.blocks.core import Block

    Block.delete(f"gpuflow-gpu-fleet/{name}")
    print(f"fleet {name} deleted")
    return EXIT_OK
