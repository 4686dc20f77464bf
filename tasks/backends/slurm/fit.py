"""Would the cluster ever run this allocation? Read from sinfo, said in a user's words
before anything is submitted. Pure: the text sinfo printed in, one sentence out."""

from __future__ import annotations

import re

from pydantic import BaseModel

# `sinfo -h -N -o SINFO_FORMAT`: one row per node and partition
SINFO_FORMAT = "%P|%N|%G|%l"
# `sinfo -h -N -p PARTITION -O IDLE_FORMAT`: each node's GPUs and those in use, by column
IDLE_FORMAT = "NodeList:40,Gres:60,GresUsed:60,StateCompact:12"
# node states whose idle GPUs a job can have now
UP_STATES = ("idle", "mix", "alloc")


class NodeRow(BaseModel):
    partition: str
    default: bool  # the cluster's default partition
    node: str
    gpus: dict[str, int]  # gres type ("" when untyped) -> count on the node
    max_minutes: int | None  # the partition's time limit; None: none


class Request(BaseModel):
    """The allocation a run asks for."""

    partition: str | None  # None: the cluster's default
    nodes: int
    gpus: int  # per node
    gres_type: str | None  # None: any type
    minutes: int


def parse_sinfo(text: str) -> list[NodeRow]:
    """Return the rows `sinfo -h -N -o SINFO_FORMAT` printed."""
    rows = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 4:
            continue
        partition, node, gres, limit = parts
        rows.append(
            NodeRow(
                partition=partition.rstrip("*"),
                default=partition.endswith("*"),
                node=node,
                gpus=_gpus(gres),
                max_minutes=_minutes(limit),
            )
        )
    return rows


def idle_gpus(text: str) -> dict[str, int]:
    """Return the GPUs free now by gres type, from `sinfo -O IDLE_FORMAT` rows (nodes that
    are down, drained or not responding count none)."""
    free: dict[str, int] = {}
    for node in free_by_node(text):
        for kind, count in node.items():
            free[kind] = free.get(kind, 0) + count
    return free


def free_by_node(text: str) -> list[dict[str, int]]:
    """Return each up node's GPUs free now by gres type, from `sinfo -O IDLE_FORMAT` rows."""
    nodes = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) != 4 or fields[3].rstrip("*~#!%$@^-") not in UP_STATES:
            continue
        used = _gpus(fields[2])
        nodes.append({k: max(0, n - used.get(k, 0)) for k, n in _gpus(fields[1]).items()})
    return nodes


def room_now(text: str, gpus: int, gres_type: str | None) -> tuple[int, int]:
    """Return the GPUs of `gres_type` (None: any) free now and how many up nodes have
    `gpus` of them free, from `sinfo -O IDLE_FORMAT` rows."""
    counts = [
        sum(n for k, n in node.items() if gres_type in (None, k)) for node in free_by_node(text)
    ]
    return sum(counts), sum(1 for c in counts if c >= gpus)


def _gpus(gres: str) -> dict[str, int]:
    """Return the GPUs of a gres string: "gpu:h100:4(S:0),gpu:l4:2" -> {h100: 4, l4: 2}."""
    found: dict[str, int] = {}
    for item in gres.split(","):
        item = re.sub(r"\(.*?\)", "", item).strip()
        parts = item.split(":")
        if parts[0] != "gpu" or len(parts) < 2:
            continue
        kind, count = (parts[1], parts[2]) if len(parts) >= 3 else ("", parts[1])
        if count.isdigit():
            found[kind] = found.get(kind, 0) + int(count)
    return found


def _minutes(limit: str) -> int | None:
    """Return sinfo's time limit in minutes: "infinite", "60", "1:00:00", "1-00:00:00"."""
    if limit in ("infinite", "UNLIMITED", "n/a", ""):
        return None
    days, _, clock = limit.rpartition("-")
    fields = [int(f) for f in clock.split(":")]
    # "M", "M:S" or "H:M:S"
    hours, minutes, seconds = {1: [0, *fields, 0], 2: [0, *fields], 3: fields}[len(fields)]
    return int(days or 0) * 1440 + hours * 60 + minutes + (1 if seconds else 0)


def refusal(request: Request, rows: list[NodeRow]) -> str | None:
    """Return why the cluster could never run `request`, as one sentence with its fix;
    None when some nodes of its partition fit."""
    partitions = sorted({r.partition for r in rows})
    if request.partition is None:
        default = next((r.partition for r in rows if r.default), None)
        if default is None:
            return (
                "placement.partition: the Slurm cluster has no default partition; name one"
                f" of: {', '.join(partitions)}."
            )
        name = default
    else:
        name = request.partition
        if name not in partitions:
            return (
                f"placement.partition: {name!r} is not a partition of this Slurm cluster;"
                f" use one of: {', '.join(partitions)}."
            )
    nodes = [r for r in rows if r.partition == name]
    limit = nodes[0].max_minutes if nodes else None
    if limit is not None and request.minutes > limit:
        return (
            f"limits.max_duration: with its grace the allocation needs {request.minutes} min,"
            f" and partition {name} allows {limit} min; lower limits.max_duration or use"
            " another partition."
        )
    if request.gpus == 0:
        if request.nodes > len(nodes):
            return _too_many_nodes(request, name, len(nodes), "")
        return None
    kind = request.gres_type
    wanted = f"gpu:{kind}" if kind else "gpu"
    if kind is not None and not any(kind in r.gpus for r in nodes):
        types = sorted({f"gpu:{t}" for r in nodes for t in r.gpus if t})
        have = f"it has {', '.join(types)}" if types else "it has no typed GPUs"
        return (
            f"resources.gpu_product: no node of partition {name} has {wanted} ({have});"
            " ask for a product it has, or another partition."
        )
    sizes = [r.gpus.get(kind, 0) if kind else sum(r.gpus.values()) for r in nodes]
    largest = max(sizes, default=0)
    if request.gpus > largest:
        more = -(-request.gpus * request.nodes // largest) if largest else 0
        spread = f" or use {more} nodes" if largest and more <= len(nodes) else ""
        return (
            f"resources.gpus: the job needs {request.gpus} x {wanted} on one node; the largest"
            f" node in partition {name} has {largest}; lower resources.gpus{spread}."
        )
    fitting = sum(1 for size in sizes if size >= request.gpus)
    if request.nodes > fitting:
        return _too_many_nodes(request, name, fitting, f" with {request.gpus} x {wanted}")
    return None


def _too_many_nodes(request: Request, partition: str, have: int, each: str) -> str:
    return (
        f"resources.nodes: the job needs {request.nodes} nodes{each}; partition {partition}"
        f" has {have}; lower resources.nodes or use another partition."
    )


# squeue's pending reasons that no waiting will clear, each in a user's words with its fix;
# `{want}` is the allocation asked for, `{partition}` its partition
PENDING_REASONS = {
    "ReqNodeNotAvail": "nodes it needs are down, drained or reserved ({detail}); wait for the"
    " cluster's administrators, or ask for another partition (placement.partition)",
    "PartitionNodeLimit": "partition {partition} allows fewer nodes per job than the"
    " {want} asked for; lower resources.nodes or use another partition",
    "PartitionTimeLimit": "partition {partition} allows less time than the allocation asks"
    " (limits.max_duration with its grace); lower limits.max_duration or use another"
    " partition",
    "PartitionDown": "partition {partition} is down; wait until its administrators bring it"
    " up, or use another partition (placement.partition)",
    "PartitionInactive": "partition {partition} is inactive and starts no jobs; use another"
    " partition (placement.partition)",
    "QOSMaxGRESPerUser": "the QOS allows you fewer GPUs than {want} while your other jobs"
    " hold theirs; lower resources.gpus or resources.nodes, or wait for your jobs to end",
    "QOSMaxGRESPerJob": "the QOS allows one job fewer GPUs than {want}; lower resources.gpus"
    " or resources.nodes, or use a QOS that allows more",
    "AssocGrpGRES": "your account's GPU limit is used up by its running jobs; wait for them,"
    " or use another account (the SlurmCluster block's account)",
    "AssocMaxJobsLimit": "your account runs as many jobs as it may; wait for some to end",
    "BadConstraints": "no node has the features and resources asked for ({want} with the"
    " block's sbatch_options); remove the constraint or lower resources.gpus",
    "InvalidAccount": "the account is not one you may use here; set the SlurmCluster"
    " block's account to one of yours (`sacctmgr show assoc user=$USER`)",
    "InvalidQOS": "the QOS is not one your account may use; set the SlurmCluster block's"
    " qos to one it has (`sacctmgr show assoc user=$USER format=qos`)",
    "JobHeldAdmin": "an administrator holds the job; ask them to release it",
    "JobHeldUser": "the job is held (scontrol hold); release it with scontrol release",
}


def pending_reason(reason: str, request: Request, partition: str) -> str:
    """Return why the job cannot start, from squeue's pending reason, as one sentence with
    its fix (any reason not known here is given in Slurm's words)."""
    name, _, detail = reason.partition(",")
    want = f"{request.nodes} node(s) x " + (
        f"gpu:{request.gres_type}:{request.gpus}" if request.gres_type else f"{request.gpus} GPUs"
    )
    said = PENDING_REASONS.get(name.strip())
    if said is None:
        return f"Slurm holds the job with reason {reason}"
    return said.format(want=want, partition=partition, detail=detail.strip() or "no detail")


def accounting(config: str) -> str:
    """Return the accounting plugin `scontrol show config` names ("accounting_storage/none")."""
    found = re.search(r"^AccountingStorageType\s*=\s*(\S+)", config, re.MULTILINE)
    return found.group(1) if found else ""


def qos_refusal(qos: str, plugin: str, known: list[str] | None) -> str | None:
    """Return why the cluster cannot give its jobs `qos`: it keeps no accounting (a QOS
    lives in the accounting database; without one Slurm ignores --qos, and the job would
    run without the QOS's priority and limits), or its accounting has no such QOS (`known`,
    from sacctmgr; None when sacctmgr could not say). None: it can."""
    if plugin.endswith("/none"):
        return (
            f"qos: the Slurm cluster keeps no accounting ({plugin}), so it has no QOS and"
            f" would ignore {qos!r}; remove qos from the SlurmCluster block."
        )
    if known is not None and qos not in known:
        listed = ", ".join(sorted(known)) or "none"
        return (
            f"qos: the Slurm cluster has no QOS {qos!r}; use one of: {listed}"
            " (`sacctmgr show qos`)."
        )
    return None
