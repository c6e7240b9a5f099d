#!/usr/bin/env python3
"""Run mypy on the four packages under the names they are installed as.

pyproject.toml installs the folders node/, protocol/, algorithms/ and launch/ as
meshfl.node, meshfl.protocol, meshfl.algorithms and meshfl.launch. An editable
install does that with an import hook that mypy cannot see, so mypy finds no
`meshfl` package here. This script builds a temporary `meshfl/` package that
mirrors the four folders with symlinks to their Python files, runs mypy there with
pyproject.toml's [tool.mypy] settings, and prints mypy's report with the paths
of this repository (meshfl/node/x.py becomes node/x.py).

Only Python files are linked, not whole folders: a data folder beside a module of
the same name would hide the module from mypy (python/mypy#13663), while Python
imports the module; none is left (launch/experiments/ holds the experiments' yaml,
launch/experiment_runs.py runs them), but the links keep it that way.

Usage: python .ci/typecheck.py [extra mypy arguments]
The exit status is mypy's.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("node", "protocol", "algorithms", "launch")


def mirror(source: Path, target: Path) -> None:
    """Link the Python files of `source` into `target`, and so on down every subfolder
    that holds Python files."""
    target.mkdir()
    for entry in sorted(source.iterdir()):
        if entry.is_file() and entry.suffix in (".py", ".pyi"):
            (target / entry.name).symlink_to(entry)
        elif entry.is_dir() and any(entry.rglob("*.py")):
            mirror(entry, target / entry.name)


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="meshfl-typecheck-") as tmp:
        meshfl = Path(tmp) / "meshfl"
        meshfl.mkdir()
        for name in PACKAGES:
            mirror(ROOT / name, meshfl / name)
        command = [sys.executable, "-m", "mypy"]
        command += ["--config-file", str(ROOT / "pyproject.toml")]
        command += ["--cache-dir", str(ROOT / ".mypy_cache")]  # kept between runs
        for name in PACKAGES:
            command += ["-p", f"meshfl.{name}"]
        result = subprocess.run(command + argv, cwd=tmp, capture_output=True, text=True)
    ours = re.compile(rf"^meshfl/({'|'.join(PACKAGES)})/", re.MULTILINE)
    sys.stdout.write(ours.sub(r"\1/", result.stdout))
    sys.stderr.write(result.stderr)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
