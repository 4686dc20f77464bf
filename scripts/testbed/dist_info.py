"""Installs a project where its files already lie: writes its `NAME-VERSION.dist-info`
(METADATA, entry_points.txt) beside them and a program for each [project.scripts] entry, as
pip would, for an image whose code is copied in and put on PYTHONPATH.

    python3 dist_info.py pyproject.toml --into /image/opt/gpuflow --scripts /image/usr/local/bin

Entry points are what Prefect reads to find gpuflow's worker type (`prefect.collections`).
The programs run the image's Python (/usr/bin/python3). Standard library only.
"""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path

PYTHON = "/usr/bin/python3"


def install(pyproject: Path, into: Path, scripts: Path) -> Path:
    """Write the dist-info folder into `into` and the programs into `scripts`; return the
    dist-info folder."""
    project = tomllib.loads(pyproject.read_text())["project"]
    name, version = project["name"], project["version"]
    info = into / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "INSTALLER").write_text("gpuflow-image\n")
    groups = {"console_scripts": project.get("scripts", {}), **project.get("entry-points", {})}
    lines = []
    for group, entries in groups.items():
        if entries:
            lines += [f"[{group}]", *(f"{k} = {v}" for k, v in entries.items()), ""]
    (info / "entry_points.txt").write_text("\n".join(lines))
    scripts.mkdir(parents=True, exist_ok=True)
    for program, target in project.get("scripts", {}).items():
        module, _, attr = target.partition(":")
        path = scripts / program
        path.write_text(
            f"#!{PYTHON}\nimport sys\nfrom {module} import {attr}\nsys.exit({attr}())\n"
        )
        path.chmod(0o755)
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pyproject", type=Path)
    parser.add_argument("--into", type=Path, required=True, help="where the code lies")
    parser.add_argument("--scripts", type=Path, required=True, help="where its programs go")
    args = parser.parse_args()
    install(args.pyproject, args.into, args.scripts)


if __name__ == "__main__":
    main()
