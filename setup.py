"""Package discovery for the wheel: every package under the four source roots, found rather than listed.

`passes/`, `plugins/` and `models/` stay at the repository's top level (as the project was specified)
and install as `snapcompile.passes`, `snapcompile.plugins` and `snapcompile.models`. Everything else
about the package is in pyproject.toml.
"""
from setuptools import find_packages, setup

ROOTS = {"snapcompile": "snapcompile", "snapcompile.models": "models", "snapcompile.passes": "passes",
         "snapcompile.plugins": "plugins"}


def discovered() -> tuple[list[str], dict[str, str]]:
    """Every package under each root, named under its import prefix, and where each root lives."""
    packages = []
    for prefix, folder in ROOTS.items():
        packages += [prefix, *(f"{prefix}.{name}" for name in find_packages(folder))]
    return packages, dict(ROOTS)


packages, package_dir = discovered()
setup(packages=packages, package_dir=package_dir)
