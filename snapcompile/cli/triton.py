"""`snapcompile triton-repo` and `snapcompile triton-serve`."""
from __future__ import annotations

import json
import signal
import sys
import tempfile
from pathlib import Path

import click

from snapcompile.cli.options import session_cache_option
from snapcompile.runtime import BACKENDS


@click.command(name="triton-repo")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path),
              help="Model repository folder to write (atomically).")
@click.option("--model-name", default=None, help="The Triton model name (default: the artifact folder's name).")
@click.option("--instances", default=1, show_default=True, type=click.IntRange(min=1),
              help="Model instances per server (each loads the artifact and owns its slots).")
@click.option("--backend", type=click.Choice(BACKENDS), default="ort", show_default=True,
              help="ort: ONNX Runtime; trt: TensorRT engines from `snapcompile build` (needs a GPU).")
@click.option("--slots", type=click.IntRange(min=1), default=None,
              help="Serve at most this many requests at once per instance (default: the artifact's slots).")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="ONNX Runtime threads per instance (default: all cores; with K instances, cores / K).")
@click.option("--link", is_flag=True, help="Link to the artifact instead of copying it into the repository.")
@click.option("--force", is_flag=True, help="Replace the output folder if snapcompile wrote it.")
@click.option("--json", "as_json", is_flag=True, help="Print what was written as one JSON object.")
@session_cache_option(sharing=True)
def triton_repo(artifact, output, model_name, instances, backend, slots, threads, link, force, session_cache_bytes,
                session_keep, session_sharing, as_json):
    """Write a Triton Inference Server model repository that serves ARTIFACT.

    The model is a decoupled Python-backend model: inputs text_input (BYTES) and optional
    max_tokens, temperature, top_p, seed, stop, stream, cache_salt; outputs text_output plus prompt_tokens,
    completion_tokens and finish_reason. It works with Triton's generate extension
    (/v2/models/NAME/generate, and /generate_stream with "stream": true) and tritonclient. Needs no
    Triton to write; serve it with `snapcompile triton-serve` or `tritonserver --model-repository`.
    """
    from snapcompile.tritonserver.repository import write_repository
    name = model_name or Path(artifact).resolve().name
    info = write_repository(artifact, output, name, instances, backend, slots, link, force, threads,
                            session_cache_bytes, session_keep, session_sharing)
    if as_json:
        click.echo(json.dumps(info))
    else:
        click.echo(f"wrote {output}: model {name}, {instances} instance(s), artifact {info['artifact_placed']}")


@click.command(name="triton-serve")
@click.argument("repository", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address of the HTTP, gRPC and metrics ports.")
@click.option("--http-port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option("--grpc-port", default=8001, show_default=True, type=click.IntRange(0, 65535))
@click.option("--metrics-port", default=8002, show_default=True, type=click.IntRange(0, 65535))
@click.option("--workdir", type=click.Path(path_type=Path), default=None,
              help="Where the server's runnable copy is laid out (default: a temporary folder).")
def triton_serve(repository, host, http_port, grpc_port, metrics_port, workdir):
    """Run the tritonserver of the nvidia-pytriton wheel on REPOSITORY until SIGTERM or Ctrl-C.

    For machines without a Triton container: it lays out the wheel's server with the
    Python-backend stub for this Python and starts it. Its exit code is the server's.
    """
    from snapcompile.errors import SnapcompileError
    from snapcompile.tritonserver.launch import start
    from snapcompile.tritonserver.repository import MARKER
    if not (Path(repository) / MARKER).is_file():
        raise SnapcompileError(f"{repository} is not a repository written by `snapcompile triton-repo`")
    with tempfile.TemporaryDirectory(prefix="snapcompile-triton-") as scratch:
        process = start(Path(repository), Path(workdir or scratch), host, http_port, grpc_port, metrics_port)
        def forward(signum, frame):            # tritonserver drains and stops on its own signal
            process.send_signal(signum)
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, forward)
        sys.exit(process.wait())
