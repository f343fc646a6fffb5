"""The package as users install it: a wheel built from the project's files, installed into a fresh
virtual environment with no source tree on the path, imports every module and runs the CLI.

The fresh environment reaches the dependencies through a .pth line naming this environment's
site-packages (a line of a .pth file adds a folder; the editable install's own .pth files there are
not processed), so nothing is downloaded and only snapcompile itself comes from the wheel."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNS_INSIDE_TRITON = {   # imported by tritonserver's Python backend, which provides this module
    "snapcompile.tritonserver.model": "No module named 'triton_python_backend_utils'"}
IMPORT_EVERY_MODULE = """
import importlib, json, pkgutil, sys
import snapcompile
names = [m.name for m in pkgutil.walk_packages(snapcompile.__path__, "snapcompile.")
         if not m.name.endswith(".__main__")]     # running it is running the CLI
failed = {}
for name in names:
    try:
        importlib.import_module(name)
    except ImportError as err:
        failed[name] = str(err)
print(json.dumps({"file": snapcompile.__file__, "modules": names, "failed": failed}))
"""


def _project_files(target: Path) -> None:
    """The files a clean checkout has (tracked, and untracked ones git does not ignore) copied to target."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                            check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(the fresh environment's python, a folder to run it from) with the wheel installed."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the project's git checkout to know its files")
    tmp = tmp_path_factory.mktemp("wheel")
    _project_files(tmp / "src")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                            "-q", "-w", str(tmp / "dist"), str(tmp / "src")], capture_output=True, text=True,
                           timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    wheel, = (tmp / "dist").glob("snapcompile-*.whl")
    env = tmp / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=120)
    python = env / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    (Path(purelib) / "snapcompile-test-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                              "--no-index", "-q", str(wheel)], capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-3000:]
    away = tmp / "elsewhere"
    away.mkdir()
    return python, away


def _run(python: Path, cwd: Path, *args, timeout=300):
    environment = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    done = subprocess.run([str(python), *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=environment)
    assert done.returncode == 0, (args, done.stdout[-2000:], done.stderr[-3000:])
    return done.stdout


def test_the_installed_wheel_imports_every_module_from_itself(installed):
    python, away = installed
    report = json.loads(_run(python, away, "-c", IMPORT_EVERY_MODULE))
    assert Path(report["file"]).is_relative_to(python.parents[1]), report["file"]
    assert report["failed"] == RUNS_INSIDE_TRITON, report["failed"]
    for package in ("snapcompile.passes", "snapcompile.plugins", "snapcompile.models", "snapcompile.tritonserver",
                    "snapcompile.sessions", "snapcompile.compiler"):
        assert any(name.startswith(package + ".") for name in report["modules"]), package
    source_modules = {".".join(p.relative_to(ROOT / "snapcompile").with_suffix("").parts)
                      for p in (ROOT / "snapcompile").rglob("*.py") if p.name not in ("__init__.py", "__main__.py")}
    assert {f"snapcompile.{name}" for name in source_modules} <= set(report["modules"])


def test_the_installed_cli_converts_runs_and_writes_a_triton_repository(installed):
    python, away = installed
    cli = python.parent / "snapcompile"
    assert "convert" in _run(python, away, "-m", "snapcompile.cli", "--help")
    assert cli.exists() and "Usage" in subprocess.run([str(cli), "--help"], capture_output=True, text=True).stdout
    _run(python, away, cli, "convert", "tiny-llama", "-o", "art", "--max-context", 256, "--budget", 64, "--slots", 2)
    result = json.loads(_run(python, away, cli, "run", "art", "--prompt", "hello", "--max-new-tokens", 4, "--json"))
    assert result, "run printed no result"
    _run(python, away, cli, "triton-repo", "art", "-o", "repo", "--model-name", "tiny")
    assert (away / "repo" / "tiny" / "1" / "model.py").is_file()
