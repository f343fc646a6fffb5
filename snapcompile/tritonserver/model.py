"""Triton Python-backend model serving a snapcompile artifact (written by `snapcompile triton-repo`).

Thin on purpose: the engine and the request handling live in snapcompile.tritonserver.worker. The
artifact sits beside this file (parameter `artifact`); its manifest must match the recorded
fingerprint. SNAPCOMPILE_SITE_PACKAGES (set by `snapcompile triton-serve`) names the site-packages
that hold snapcompile when Triton's Python is not the one it was installed into.
"""
import json
import os
import site
import sys
from pathlib import Path


def _add_site_packages() -> None:
    """Put SNAPCOMPILE_SITE_PACKAGES (with their .pth files) before the interpreter's own."""
    before = list(sys.path)
    for path in filter(None, os.environ.get("SNAPCOMPILE_SITE_PACKAGES", "").split(os.pathsep)):
        site.addsitedir(path)
    added = [p for p in sys.path if p not in before]
    sys.path[:] = before[:1] + added + before[1:]      # after the working folder (numpy<2), before the rest


_add_site_packages()

import triton_python_backend_utils as pb_utils  # noqa: E402  (after the site-packages above)


class TritonPythonModel:
    def initialize(self, args):
        from snapcompile.config import DEFAULT_SESSION_KEEP
        from snapcompile.tritonserver.worker import TritonWorker
        config = json.loads(args["model_config"])
        params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        folder = Path(args["model_repository"]) / args["model_version"] / params["artifact"]
        slots = int(params["slots"]) if params.get("slots") else None
        threads = int(params["threads"]) if params.get("threads") else None
        cache = params.get("session_cache_bytes", "auto")
        self.worker = TritonWorker(pb_utils, folder, params["fingerprint"], slots, params.get("backend", "ort"),
                                   threads, None if cache == "auto" else int(cache),
                                   params.get("session_keep", DEFAULT_SESSION_KEEP),
                                   params.get("session_sharing", "private"))

    def execute(self, requests):
        for request in requests:
            self.worker.submit(request)
        return None

    def finalize(self):
        self.worker.stop()
