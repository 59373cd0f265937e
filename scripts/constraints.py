"""Write (or with --check, compare) constraints.txt: the version installed in this
environment of every package that hoist's dependencies, and those of its `sample` and
`dev` extras, pull in (the dependency closure, markers evaluated here).

.venv/bin/python scripts/constraints.py [--check]

The image installs with `pip install -c constraints.txt .` and the test command with
`pip install -c constraints.txt -e '.[sample,dev]'`, so both get these versions. The
`cuda` extra (PyTorch) is left out: the CUDA image takes PyTorch from its base image.
"""

from __future__ import annotations

import argparse
import platform
import sys
import tomllib
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
PINNED_EXTRAS = ("sample", "dev")
"""Extras whose closure is pinned besides the runtime dependencies."""
UNPINNED_EXTRAS = ("cuda",)
"""Extras left to the base image (PyTorch and its CUDA libraries)."""


def project_requirements(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, list[Requirement]]:
    """The requirements of pyproject.toml: ``{"": runtime, extra: [...]}``."""
    project = tomllib.loads(pyproject.read_text())["project"]
    groups = {"": [Requirement(r) for r in project["dependencies"]]}
    for extra, reqs in project.get("optional-dependencies", {}).items():
        groups[extra] = [Requirement(r) for r in reqs]
    return groups


def _applies(req: Requirement, extras: Iterable[str]) -> bool:
    if req.marker is None:
        return True
    env = {key: str(value) for key, value in default_environment().items()}
    return any(req.marker.evaluate({**env, "extra": e}) for e in ("", *extras))


def closure(roots: Iterable[Requirement]) -> dict[str, metadata.Distribution]:
    """Every installed distribution that ``roots`` need here, by canonical name.

    Raises:
        metadata.PackageNotFoundError: a needed distribution is not installed.
    """
    found: dict[str, metadata.Distribution] = {}
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(r, frozenset[str]()) for r in roots if _applies(r, ())]
    while todo:
        req, _ = todo.pop()
        name = canonicalize_name(req.name)
        key = (name, frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        dist = found.get(name) or metadata.distribution(req.name)
        found[name] = dist
        for text in dist.requires or []:
            sub = Requirement(text)
            if _applies(sub, req.extras):
                todo.append((sub, frozenset()))
    return found


def pins() -> tuple[dict[str, str], dict[str, str]]:
    """(runtime pins, pins only the pinned extras need), name -> version."""
    groups = project_requirements()
    runtime = closure(groups[""])
    runtime.pop("hoist", None)
    extra_roots = [r for e in PINNED_EXTRAS for r in groups.get(e, [])]
    extras = {n: d for n, d in closure(extra_roots).items() if n not in runtime and n != "hoist"}
    return ({n: d.version for n, d in runtime.items()}, {n: d.version for n, d in extras.items()})


def render(runtime: dict[str, str], extras: dict[str, str]) -> str:
    """The text of constraints.txt."""
    py = ".".join(platform.python_version_tuple()[:2])
    lines = [
        "# Versions every install of hoist uses: the image (pip install -c constraints.txt .) and",
        "# the test command (pip install -c constraints.txt -e '.[sample,dev]').",
        f"# Written by scripts/constraints.py on Python {py}, {platform.system()} {platform.machine()};",
        "# python_version below is the one the image must use.",
        f"# python_version: {py}",
        "",
        "# runtime: the dependencies of hoist and everything they need",
        *(f"{n}=={v}" for n, v in sorted(runtime.items())),
        "",
        f"# extras {', '.join(PINNED_EXTRAS)}: what they need besides the runtime",
        *(f"{n}=={v}" for n, v in sorted(extras.items())),
    ]
    return "\n".join(lines) + "\n"


def parse(text: str) -> dict[str, str]:
    """``name==version`` lines of a constraints file, by canonical name.

    Raises:
        ValueError: a line that is not an exact pin, or a package pinned twice.
    """
    out: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        specs = list(req.specifier)
        if len(specs) != 1 or specs[0].operator != "==" or req.marker or req.extras or req.url:
            raise ValueError(f"constraints.txt line {number}: {raw!r} is not an exact pin")
        name = canonicalize_name(req.name)
        if name in out:
            raise ValueError(f"constraints.txt line {number}: {req.name} is pinned twice")
        out[name] = specs[0].version
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 when constraints.txt is not current")
    args = parser.parse_args()
    path = ROOT / "constraints.txt"
    new = render(*pins())
    if args.check:
        if not path.exists() or path.read_text() != new:
            sys.stderr.write("constraints.txt does not match this environment; run scripts/constraints.py\n")
            return 1
        return 0
    path.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
