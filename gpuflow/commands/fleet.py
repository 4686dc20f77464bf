"""`gpuflow fleet apply | status | delete | scale`: GPU servers that outlive a run (a
GpuFleet block). `apply` saves a fleet from its YAML (or takes a saved one), reaches every
host over SSH, puts this gpuflow there and checks it; the hosts that pass serve, each other
one is named with its reason; an elastic fleet's EC2 side is checked (its Ec2GpuFleet, the
instance types offered). `status` asks each host what holds its GPUs now, and what each
instance has cost; `delete` removes the block once no run holds a GPU of it (an elastic
fleet's instances, security group and records with it); `scale` is one period of an
elastic fleet's scaler."""

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
    scale = verbs.add_parser(
        "scale",
        description="One period of an elastic fleet's scaler (the fleet-scale deployment's):"
        " grow it for runs that waited, end instances idle past idle_duration_s.",
    )
    scale.add_argument("name", help="the fleet's name")
    scale.set_defaults(handler=lambda args: run(lambda: _scale(args.name)))
    return [("fleet", "GPU servers that outlive a run: apply, status, delete, scale")]


def backend_of(name: str, fleet: Any = None) -> Any:
    """Return the fleet backend of fleet `name` (its block as `fleet` when given: one not
    saved yet)."""
    from gpuflow.tasks.backends import registry  # noqa: F401  (an elastic fleet's clouds)
    from gpuflow.tasks.backends.fleet.backend import FleetBackend

    return FleetBackend(name, fleet)


def all_hosts(backend: Any) -> list[Any]:
    """Return the fleet's listed hosts and its elastic instances that serve."""
    fleet = backend.fleet()
    listed = {h.label for h in fleet.hosts}
    return [*fleet.hosts, *(h for h, _ in backend.hosts() if h.label not in listed)]


def run(body: Any) -> int:
    return session.with_api(lambda api: body())


def read_fleet(source: str) -> tuple[str, Any]:
    """Return the fleet's name and its GpuFleet: from a YAML file, or the block saved under
    `source`. InvalidSpec, one sentence per problem, for a bad one."""
    from pydantic import ValidationError

    from gpuflow.blocks.gpu_fleet import GpuFleet
    from gpuflow.tasks import yamlfile
    from gpuflow.tasks.backends.fleet.state import fleet_block
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
    from gpuflow.tasks.backends.fleet.hosts import check_host
    from gpuflow.tasks.backends.fleet.state import secret_text
    from gpuflow.tasks.errors import InvalidSpec

    try:
        name, fleet = read_fleet(source)
    except InvalidSpec as exc:
        return invalid(exc)
    section = fleet.elastic
    if not fleet.hosts and section is None:
        return invalid(
            InvalidSpec(
                f"hosts: fleet {name!r} has no hosts; list at least one, or add a cloud to"
                " grow on (ec2:, alibaba: or tencent:)."
            )
        )
    elastic = None
    if section is not None:
        try:
            nodes = backend_of(name, fleet).nodes()
            elastic = nodes.instance_gpus(), len(nodes.instances())
        except InvalidSpec as exc:
            return invalid(exc)
    checks = []
    if fleet.hosts:
        with ThreadPoolExecutor(max_workers=min(16, len(fleet.hosts))) as pool:
            checks = list(pool.map(lambda host: check_host(fleet, host, secret_text), fleet.hosts))
    fleet.checked = checks
    fleet.save(name, overwrite=True)
    if elastic is not None and section is not None and not as_json:
        (gpus, product, hourly), running = elastic
        print(
            f"fleet {name}: elastic, {running} instance(s) now, {section.nodes.min}..{section.nodes.max};"
            f" a new one is a {section.instance_types[0]} ({gpus} x {product},"
            f" {section.market}, ${hourly:.3f}/h), ended after {section.idle_duration_s:.0f} s idle"
        )
        if not checks:
            return EXIT_OK
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
    from gpuflow.tasks.backends.fleet.state import fleet_block
    from gpuflow.tasks.backends.fleet.unit import host_status
    from gpuflow.tasks.errors import InvalidSpec

    try:
        fleet = fleet_block(name)
        backend = backend_of(name, fleet)
        hosts = all_hosts(backend)
        nodes = backend.nodes()
        instances = {i.id: i for i in nodes.instances()} if nodes is not None else {}
    except InvalidSpec as exc:
        return invalid(exc)
    with ThreadPoolExecutor(max_workers=min(16, max(1, len(hosts)))) as pool:
        found = list(pool.map(lambda host: host_status(fleet, host), hosts))
    rows = [{"host": host.label, **said} for host, said in zip(hosts, found, strict=True)]
    costs = _instance_costs(instances, rows)
    ledger = nodes.ledger() if nodes is not None else []
    if as_json:
        print(json.dumps({"hosts": rows, "instances": costs, "ended": ledger}, indent=1))
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
    for cost in costs:
        print(
            f"  {cost['instance']:16} {cost['instance_type']} {cost['market']}, up"
            f" {cost['hours']:.2f} h, ${cost['cost_usd']:.3f} so far, of it idle ${cost['idle_cost_usd']:.3f}"
        )
    if ledger:
        idle = sum(r.get("idle_cost_usd", 0.0) for r in ledger)
        total = sum(r.get("cost_usd", 0.0) for r in ledger)
        print(f"  {len(ledger)} instance(s) ended: ${total:.3f}, of it idle (nobody's) ${idle:.3f}")
    return EXIT_OK


def _instance_costs(instances: dict[str, Any], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Return each elastic instance's hours, cost so far and idle cost."""
    import time

    from gpuflow.tasks.backends.elastic import cost_of

    usage = {row["host"]: row.get("usage", {}) for row in rows}
    return [cost_of(i, usage.get(i.id, {}), time.time()) for i in instances.values()]


def _delete(name: str) -> int:
    from gpuflow.tasks.backends.fleet.state import fleet_block
    from gpuflow.tasks.backends.fleet.unit import host_status
    from gpuflow.tasks.errors import InvalidSpec

    try:
        fleet = fleet_block(name)
        backend = backend_of(name, fleet)
        hosts = all_hosts(backend)
        nodes = backend.nodes()
    except InvalidSpec as exc:
        return invalid(exc)
    busy = []
    for host in hosts:
        said = host_status(fleet, host)
        busy += [f"{host.label}: {run['name']}" for run in said.get("runs", [])]
    if busy:
        session.fail(
            f"fleet {name!r} still has runs holding its GPUs ({'; '.join(busy)}); cancel"
            " them (`gpuflow cancel`) or wait for them to end, then delete it."
        )
        return EXIT_FAILED
    if nodes is not None:
        instances = [i.id for i in nodes.instances()]
        nodes.end(instances, print)
        nodes.remove_all(print)
    from prefect.blocks.core import Block

    Block.delete(f"gpuflow-gpu-fleet/{name}")
    print(f"fleet {name} deleted")
    return EXIT_OK


def _scale(name: str) -> int:
    from gpuflow.flows.fleet_scale import fleet_scale
    from gpuflow.tasks.errors import InvalidSpec

    try:
        backend_of(name).nodes()
    except InvalidSpec as exc:
        return invalid(exc)
    rows = fleet_scale(name)
    for row in rows:
        print(f"{row['action']:7} {row['instance'] or '-':20} {row['why']}")
    return EXIT_OK
