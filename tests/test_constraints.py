"""constraints.txt, which the image and the test command install from, pins every package
hoist needs at run time (and those its `sample` and `dev` extras need), each at a version
pyproject.toml and the packages that require it accept."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent


def script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("constraints_script", ROOT / "scripts" / "constraints.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pins() -> dict[str, str]:
    out: dict[str, str] = script().parse((ROOT / "constraints.txt").read_text())
    return out


def test_every_line_is_an_exact_pin_of_one_package() -> None:
    parse = script().parse
    assert pins()
    for bad in ("numpy>=2", "numpy", "numpy==2.0 ; python_version<'3.12'", "uvicorn[standard]==0.30"):
        with pytest.raises(ValueError, match="not an exact pin"):
            parse(bad + "\n")
    with pytest.raises(ValueError, match="pinned twice"):
        parse("PyYAML==6.0\npyyaml==6.0.1\n")


def test_every_requirement_of_pyproject_is_pinned_within_its_range() -> None:
    module = script()
    groups = module.project_requirements()
    pinned = pins()
    for group in ("", *module.PINNED_EXTRAS):
        for req in groups[group]:
            name = canonicalize_name(req.name)
            assert name in pinned, f"{req} ({group or 'runtime'}) is not pinned"
            assert req.specifier.contains(pinned[name], prereleases=True), f"{req}: pinned {pinned[name]}"
    # PyTorch is the CUDA base image's, not pinned here
    for group in module.UNPINNED_EXTRAS:
        assert all(canonicalize_name(r.name) not in pinned for r in groups[group])


def test_the_whole_dependency_closure_is_pinned_at_the_installed_versions() -> None:
    """Walks the installed packages' own metadata from pyproject's requirements: every
    package reached is pinned, at the version installed (the test command installs with
    these constraints), and each pin satisfies what the packages requiring it ask for."""
    module = script()
    groups = module.project_requirements()
    pinned = pins()
    roots = [r for g in ("", *module.PINNED_EXTRAS) for r in groups[g]]
    closure = module.closure(roots)
    closure.pop("hoist", None)
    for name, dist in closure.items():
        assert name in pinned, f"{name} is needed but not pinned: run scripts/constraints.py"
        assert dist.version == pinned[name], (
            f"{name} {dist.version} is installed but {pinned[name]} pinned: install with -c constraints.txt"
        )
        for text in dist.requires or []:
            req = Requirement(text)
            dep = canonicalize_name(req.name)
            if dep in closure and module._applies(req, ()):
                assert req.specifier.contains(pinned[dep], prereleases=True), f"{name} requires {req}"
    runtime, extras = module.pins()
    assert set(runtime) | set(extras) == set(closure)


def test_the_file_is_what_the_script_writes() -> None:
    module = script()
    text = (ROOT / "constraints.txt").read_text()
    runtime, extras = module.pins()
    rendered = module.render(runtime, extras)
    if "# python_version: " + ".".join(map(str, sys.version_info[:2])) + "\n" not in text:
        pytest.skip("written on another Python version, where markers may select other packages")
    # nothing more is pinned than the closure, nothing less
    assert rendered == text, "run scripts/constraints.py"
    # the runtime section is what the image installs: none of the extras' packages
    runtime_part = text.split("# extras")[0]
    assert set(script().parse(runtime_part)) == set(runtime)
