"""Platform and deployments: `platform up|down|status`, `blocks init`, `deploy`, `submit`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from gpuflow import session
from gpuflow.commands.common import EXIT_FAILED, EXIT_OK, invalid, number


def _platform_parser(commands: Any) -> None:
    top = commands.add_parser(
        "platform", description="A local Prefect server, pools, blocks, deployments and a worker."
    )
    actions = top.add_subparsers(dest="action", required=True, metavar="{up,down,status,user}")
    plat = actions.add_parser("up", help="start the platform (or say it runs)")
    for action, what in (("down", "stop what `up` started"), ("status", "say whether it runs")):
        actions.add_parser(action, help=what).set_defaults(
            handler=lambda args: platform(args.action, None)
        )
    _user_parser(actions)
    _quota_parser(actions)
    plat.add_argument(
        "--port", type=number(1, 65535), default=None, help="server port (default 4200)"
    )
    plat.add_argument(
        "--kubeconfig",
        type=Path,
        help="also start a Kubernetes worker for the gpuflow-gpu-k8s pool on this cluster"
        " and deploy the Kubernetes deployments",
    )
    plat.add_argument(
        "--image",
        help="job image the Kubernetes deployments run, already pushed (default:"
        " $GPUFLOW_IMAGE); nothing is built",
    )
    plat.add_argument(
        "--database",
        choices=["sqlite", "postgresql"],
        default="sqlite",
        help="where the server keeps runs and logs: SQLite under $GPUFLOW_HOME/platform, or a"
        " PostgreSQL server started for the platform from the host's PostgreSQL (Debian's"
        " postgresql package), for many runs at once",
    )
    plat.add_argument(
        "--listen",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: this machine only); an address of this"
        " host, or 0.0.0.0 for all, shares the platform with a team over TLS 1.3",
    )
    plat.add_argument(
        "--use",
        action="store_true",
        help="up: make the platform's Prefect profile (gpuflow) the active one, so Prefect's"
        " CLI, your own flows and Secret(...).save(...) use the platform",
    )
    plat.add_argument("--tls-cert", type=Path, help="with --listen: the certificate (PEM)")
    plat.add_argument(
        "--tls-key",
        type=Path,
        help="with --listen: its private key (PEM); without both, one is generated for this host",
    )
    plat.set_defaults(
        handler=lambda args: platform(
            args.action,
            args.port,
            args.kubeconfig,
            args.image,
            args.database,
            (args.listen, args.tls_cert, args.tls_key),
            args.use,
        )
    )


def _user_parser(actions: Any) -> None:
    user = actions.add_parser(
        "user",
        help="the platform's users: add, ls, revoke",
        description="People and service accounts of a shared platform, each with a token"
        " (shown once) and a role: viewer reads; member also makes runs and changes its own;"
        " admin does everything.",
    )
    verbs = user.add_subparsers(dest="verb", required=True, metavar="{add,ls,revoke}")
    add = verbs.add_parser("add", help="make a user and print its auth string, once")
    add.add_argument("name", help="lower-case letters, digits, '.', '_', '-' (alice, ci-bot)")
    add.add_argument("--role", default="member", help="viewer, member (default) or admin")
    add.add_argument("--service", action="store_true", help="a service account (CI), not a person")
    add.add_argument(
        "--renew", action="store_true", help="a new token (and role) for an existing user"
    )
    add.add_argument("--team", help="the team whose GPU quota its runs count against")
    add.set_defaults(
        handler=lambda args: user_add(args.name, args.role, args.service, args.renew, args.team)
    )
    verbs.add_parser("ls", help="list the users").set_defaults(handler=lambda args: user_ls())
    revoke = verbs.add_parser("revoke", help="end a user's token from the next request on")
    revoke.add_argument("name")
    revoke.set_defaults(handler=lambda args: user_revoke(args.name))


def _quota_parser(actions: Any) -> None:
    quota = actions.add_parser(
        "quota",
        help="GPU quotas of teams and caps of users: set, cap, ls",
        description="Each team's nominal GPU quota per scope (* anywhere, backend:NAME,"
        " gpu:PRODUCT); runs over it borrow what other teams leave idle, and give it back"
        " when they need it.",
    )
    verbs = quota.add_subparsers(dest="verb", required=True, metavar="{set,cap,ls}")
    put = verbs.add_parser("set", help="a team's nominal GPUs in a scope (0 removes it)")
    put.add_argument("team")
    put.add_argument("--gpus", type=int, required=True)
    put.add_argument("--scope", default="*", help="* (default), backend:NAME or gpu:PRODUCT")
    put.set_defaults(handler=lambda args: quota_set(args.team, args.gpus, args.scope))
    cap = verbs.add_parser("cap", help="a user's own GPU cap within its team")
    cap.add_argument("user")
    cap.add_argument("--gpus", type=int, help="the cap; without it, the cap is removed")
    cap.set_defaults(handler=lambda args: quota_cap(args.user, args.gpus))
    verbs.add_parser("ls", help="quotas, what each team holds, and the queue").set_defaults(
        handler=lambda args: quota_ls()
    )


def quota_set(team: str, gpus: int, scope: str) -> int:
    from gpuflow.tasks.errors import InvalidSpec
    from gpuflow.tasks.platform import admission
    from gpuflow.tasks.platform.state import platform_dir

    try:
        admission.set_quota(platform_dir(), team, gpus, scope)
    except InvalidSpec as exc:
        return invalid(exc)
    _quota_beyond_gpus(team, gpus)
    print(f"team {team}: {gpus} GPUs {'anywhere' if scope == '*' else scope}")
    return EXIT_OK


def _quota_beyond_gpus(team: str, gpus: int) -> None:
    """Say (and allow) a quota larger than this host's GPUs when the platform has no other
    backend that could give them: quotas are shares, not reservations."""
    from gpuflow.tasks import nvml

    here = len(nvml.query().gpus)
    if gpus > here:
        print(
            f"gpuflow: note: team {team}'s {gpus} GPUs are more than this host's {here}; the"
            " quota holds across every backend the platform places on, and runs beyond what"
            " the backends can give wait for GPUs as before.",
            file=sys.stderr,
        )


def quota_cap(user: str, gpus: int | None) -> int:
    from gpuflow.tasks.errors import InvalidSpec
    from gpuflow.tasks.platform import admission
    from gpuflow.tasks.platform.state import platform_dir

    try:
        admission.set_cap(platform_dir(), user, gpus)
    except InvalidSpec as exc:
        return invalid(exc)
    print(f"{user}: {'no cap' if gpus is None else f'at most {gpus} GPUs'}")
    return EXIT_OK


def quota_ls() -> int:
    from gpuflow.tasks.platform import admission
    from gpuflow.tasks.platform.state import platform_dir

    folder = platform_dir()
    quotas = admission.read_quotas(folder, _book())
    rows = admission.entries_of(admission.Ledger(folder).read())
    if not quotas.teams:
        print("no quotas: runs take GPUs first come, first served (`platform quota set`)")
    for team, quota in sorted(quotas.teams.items()):
        for scope, nominal in sorted(quota.items()):
            mine = [r for r in rows if r.team == team and r.scope == scope]
            held = sum(r.gpus for r in mine if r.state in ("admitted", "yield"))
            lent = sum(r.gpus for r in mine if r.state == "borrowed")
            waiting = sum(1 for r in mine if r.state == "queued")
            where = "anywhere" if scope == "*" else scope
            print(
                f"team {team}: {nominal} GPUs {where}; holds {held}, borrows {lent},"
                f" {waiting} run(s) waiting"
            )
    for entry in sorted((r for r in rows if r.state == "queued"), key=lambda r: r.position):
        print(
            f"  {entry.position}. {entry.run[:8]} {entry.user} ({entry.gpus} GPUs): {entry.reason}"
        )
    return EXIT_OK


def _book() -> Any:
    from gpuflow.tasks.host import secure_home
    from gpuflow.tasks.platform.state import users_path
    from gpuflow.tasks.platform.users import UserBook

    secure_home()
    return UserBook(users_path())


def user_add(name: str, role: str, service: bool, renew: bool, team: str | None = None) -> int:
    """Make (or renew) a user and print its auth string once."""
    from gpuflow.tasks.errors import InvalidSpec

    kind = "service" if service else "person"
    try:
        auth = _book().add(name, role, kind, renew=renew, team=team)
    except InvalidSpec as exc:
        return invalid(exc)
    print(auth)
    print(
        f"gpuflow: {name} ({role}) sends this as PREFECT_API_AUTH_STRING (or types it in the"
        " UI's login); it is shown only now: hand it over safely.",
        file=sys.stderr,
    )
    return EXIT_OK


def user_ls() -> int:
    import time

    users = _book().users()
    if not users:
        print("no users: only the platform's own auth string gets in (`platform user add`)")
        return EXIT_OK
    print(f"{'NAME':<24} {'ROLE':<7} {'KIND':<8} {'TEAM':<16} {'MADE':<17} REVOKED")
    for user in sorted(users.values(), key=lambda u: u.name):
        made = time.strftime("%Y-%m-%d %H:%M", time.gmtime(user.created))
        gone = time.strftime("%Y-%m-%d %H:%M", time.gmtime(user.revoked)) if user.revoked else "-"
        team = user.team or "-"
        print(f"{user.name:<24} {user.role:<7} {user.kind:<8} {team:<16} {made:<17} {gone}")
    return EXIT_OK


def user_revoke(name: str) -> int:
    from gpuflow.tasks.errors import InvalidSpec

    try:
        user = _book().revoke(name)
    except InvalidSpec as exc:
        return invalid(exc)
    print(f"revoked {user.name}: its token is refused from the next request on")
    return EXIT_OK


def add(commands: Any) -> list[tuple[str, str]]:
    _platform_parser(commands)
    blk = commands.add_parser(
        "blocks", description="Register gpuflow's block types and default blocks."
    )
    blk.add_argument(
        "action", choices=["init"], help="init: register types, create what is missing"
    )
    blk.set_defaults(handler=lambda args: blocks_init())
    deploy = commands.add_parser(
        "deploy",
        description="Check prefect.yaml, then `prefect deploy` (Kubernetes deployments build"
        " and push $GPUFLOW_IMAGE first).",
    )
    deploy.add_argument(
        "--pool",
        action="append",
        choices=["gpuflow-local", "gpuflow-gpu-k8s"],
        help="deploy only the deployments on this pool (repeatable; default: all)",
    )
    deploy.set_defaults(handler=lambda args: deploy_all(args.pool))
    sub = commands.add_parser(
        "submit",
        description="Run a deployment from CI.",
        epilog="Exit codes: 0 completed; 1 failed, crashed or cancelled; 2 invalid input;"
        " 3 still running when --timeout passed.",
    )
    sub.add_argument("deployment", help="flow-name/deployment-name")
    sub.add_argument(
        "--param", action="append", default=[], help="name=value (JSON, or @file.yaml)"
    )
    sub.add_argument("--wait", action="store_true", help="follow the run until it ends")
    sub.add_argument(
        "--timeout",
        type=number(1, 30 * 86400, float),
        default=3600,
        help="seconds to wait (with --wait)",
    )
    sub.set_defaults(
        handler=lambda args: submit(args.deployment, args.param, args.wait, args.timeout)
    )
    return [
        ("platform", "a local Prefect server, pools, blocks, deployments and a worker"),
        ("blocks", "register gpuflow's block types and default blocks"),
        ("deploy", "check prefect.yaml, then `prefect deploy`"),
        ("submit", "run a deployment from CI"),
    ]


def platform(
    action: str,
    port: int | None,
    kubeconfig: Path | None = None,
    image: str | None = None,
    database: str = "sqlite",
    exposure: tuple[str, Path | None, Path | None] = ("127.0.0.1", None, None),
    use: bool = False,
) -> int:
    """Bring the local platform up or down, or say whether it runs."""
    from gpuflow.tasks.platform import local

    if action == "down":
        local.down()
        return EXIT_OK
    if action == "status":
        return _status(local)
    from gpuflow.tasks.errors import GpuflowError, InvalidSpec

    try:
        listen, cert, key = exposure
        local.up(
            port,
            kubeconfig=kubeconfig,
            image=image,
            database=database,
            listen=listen,
            tls_cert=cert,
            tls_key=key,
            use=use,
        )
    except InvalidSpec as exc:
        return invalid(exc)
    except GpuflowError as exc:
        print(f"gpuflow: {exc}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _status(local: Any) -> int:
    from gpuflow.tasks.platform.api import health_error

    state = local.read_state()
    if state is None:
        print("not running (`gpuflow platform up` starts it)")
        return EXIT_FAILED
    for name, entry in state["processes"].items():
        print(f"{name}: pid {entry['pid']} {'running' if local.running(entry) else 'gone'}")
    problem = local.half_started(state) or health_error(state["api"], timeout_s=5)
    running = problem is None and all(local.running(p) for p in state["processes"].values())
    print(f"runs kept in {local.runs_kept_in(state.get('database'))}")
    print(
        f"running: UI {state['ui']}"
        if running
        else f"not healthy: {problem or 'a process is gone'}"
    )
    return EXIT_OK if running else EXIT_FAILED


def blocks_init() -> int:
    """Register gpuflow's block types and create the default documents that are missing."""
    from gpuflow.tasks.platform.blocks_setup import init_blocks

    def body(api: Any) -> int:
        for slug, name, what in init_blocks():
            print(f"{what:>10}  {slug}{'/' + name if name else ''}")
        return EXIT_OK

    return session.with_api(body)


def deploy_all(pools: list[str] | None = None) -> int:
    """Check prefect.yaml (pools, entrypoints, parameters, triggers, job variables, the job
    image), then run `prefect deploy` for the deployments on `pools` against PREFECT_API_URL."""
    from gpuflow.tasks.errors import InvalidSpec
    from gpuflow.tasks.platform import deploy

    root = Path.cwd() if (Path.cwd() / "prefect.yaml").is_file() else deploy_root()
    try:
        names = deploy.check_project(
            deploy.load_project(root / "prefect.yaml"),
            root,
            deploy.pool_templates(),
            only=set(pools) if pools else None,
        )
    except InvalidSpec as exc:
        return invalid(exc)

    def body(api: Any) -> int:
        done = deploy.prefect_deploy(root, names=names if pools else None)
        print(done.stdout[-3000:], end="")
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            return EXIT_FAILED
        print(f"deployed {len(names)}: {', '.join(names)}")
        return EXIT_OK

    return session.with_api(body, temporary=False)


def deploy_root() -> Path:
    """Return the folder gpuflow's own prefect.yaml is in: the repository's, or the
    installed package's copy."""
    return (Path(__file__).parents[1] / "prefect.yaml").resolve().parent


def submit(name: str, pairs: list[str], wait: bool, timeout_s: float) -> int:
    """Run deployment `name` with `pairs` as parameters; follow it with `wait`."""
    from gpuflow.tasks.errors import InvalidSpec
    from gpuflow.tasks.platform.submit import EXIT_INVALID as INVALID
    from gpuflow.tasks.platform.submit import parse_params
    from gpuflow.tasks.platform.submit import submit as submit_run

    try:
        params = parse_params(pairs)
    except InvalidSpec as exc:
        invalid(exc)
        return INVALID
    return session.with_api(lambda api: submit_run(name, params, wait, timeout_s), temporary=False)
