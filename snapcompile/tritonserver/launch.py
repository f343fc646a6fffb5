"""Start the `tritonserver` binary that the `nvidia-pytriton` wheel ships, on a model repository.

The wheel's server needs, as pytriton's own launcher arranges: a copy of its `tritonserver` folder
with the Python-backend stub built for the running Python placed in `backends/python/`, the
wheel's bundled libraries (`nvidia_pytriton.libs`) and libpython's folder on LD_LIBRARY_PATH. This
module does the same in a folder of its own (never in site-packages). In a Triton container, run
`tritonserver --model-repository REPO` instead.

Two things the stub needs that pytriton's launcher leaves to its numpy<2 pin: the stub is built
against numpy 1 (with numpy 2 it receives BYTES tensors garbled), and its interpreter ignores
PYTHONPATH. So the server runs in a folder holding numpy<2 (`STUB_NUMPY`, made by
scripts/setup.sh; the stub's sys.path starts with its working folder), and model.py adds this
environment's site-packages (SNAPCOMPILE_SITE_PACKAGES) for snapcompile and its dependencies.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import site
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from snapcompile.errors import SnapcompileError

STUB_NUMPY = Path(sys.prefix) / "triton-stub-python"    # pip install --target <this> "numpy<2"
INSTALL_HINT = ('pip install "snapcompile[triton]" and pip install --no-deps nvidia-pytriton '
                "(its wheel ships tritonserver; --no-deps because only the binary is used)")


@dataclass(frozen=True)
class TritonInstall:
    binary: Path
    backend_dir: Path
    env: dict[str, str]
    workdir: Path               # the server's working folder: numpy<2 for the stub


def distribution() -> Path:
    """The `tritonserver` folder of the installed nvidia-pytriton wheel (found without importing it)."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise SnapcompileError(f"tritonserver is not installed: {INSTALL_HINT}")
    folder = Path(next(iter(spec.submodule_search_locations))) / "tritonserver"
    if not (folder / "bin" / "tritonserver").is_file():
        raise SnapcompileError(f"{folder} has no bin/tritonserver: {INSTALL_HINT}")
    return folder


def prepare(workdir: Path) -> TritonInstall:
    """Lay out a runnable server in `workdir` (a copy of the wheel's server and this Python's stub)."""
    source = distribution()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = source / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise SnapcompileError(f"nvidia-pytriton has no Python-backend stub for Python {version}")
    target = Path(workdir) / "tritonserver"
    if not target.exists():
        shutil.copytree(source, target, ignore=shutil.ignore_patterns("python_backend_stubs"))
        shutil.copy2(stub, target / "backends" / "python" / "triton_python_backend_stub")
    numpy_dir = Path(os.environ.get("SNAPCOMPILE_TRITON_NUMPY", STUB_NUMPY))
    if not (numpy_dir / "numpy").is_dir():
        raise SnapcompileError(f"{numpy_dir} holds no numpy for the Python-backend stub: "
                               f'pip install --target {numpy_dir} "numpy<2" (scripts/setup.sh does)')
    return TritonInstall(target / "bin" / "tritonserver", target / "backends", _environment(source), numpy_dir)


def _environment(source: Path) -> dict[str, str]:
    libs = source.parent.parent / "nvidia_pytriton.libs"
    paths = [str(libs), sysconfig.get_config_var("LIBDIR") or "", os.environ.get("LD_LIBRARY_PATH", "")]
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in paths if p)
    env["SNAPCOMPILE_SITE_PACKAGES"] = os.pathsep.join(site.getsitepackages())
    return env


def command(install: TritonInstall, repository: Path, host: str, http_port: int, grpc_port: int,
            metrics_port: int) -> list[str]:
    return [str(install.binary), "--model-repository", str(Path(repository).resolve()),
            "--backend-directory", str(install.backend_dir),
            "--http-address", host, "--http-port", str(http_port),
            "--grpc-address", host, "--grpc-port", str(grpc_port),
            "--metrics-address", host, "--metrics-port", str(metrics_port),
            "--exit-on-error", "true", "--log-verbose", "0"]


def start(repository: Path, workdir: Path, host: str = "127.0.0.1", http_port: int = 8000, grpc_port: int = 8001,
          metrics_port: int = 8002, **popen) -> subprocess.Popen:
    """Start tritonserver on `repository`; the caller waits for /v2/health/ready and stops it."""
    install = prepare(workdir)
    return subprocess.Popen(command(install, repository, host, http_port, grpc_port, metrics_port),
                            env=install.env, cwd=install.workdir, **popen)
