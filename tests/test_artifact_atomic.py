"""Outputs are written atomically and --force replaces only what snapcompile wrote."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from snapcompile.artifact.manifest import MANIFEST, WEIGHTS
from snapcompile.atomic import atomic_directory
from snapcompile.errors import SnapcompileError
from tests.cli_helpers import assert_one_line_error, invoke

REPO = Path(__file__).resolve().parents[1]


def test_output_appearing_while_staging_is_left_alone(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(SnapcompileError, match="appeared while it was being written"):
        with atomic_directory(target) as staging:
            (staging / "new.txt").write_text("new")
            target.mkdir()
            (target / "theirs.txt").write_text("theirs")
    assert sorted(p.name for p in target.iterdir()) == ["theirs.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_force_replaces_only_snapcompile_folders(tmp_path, monkeypatch):
    mydata = tmp_path / "mydata"
    mydata.mkdir()
    (mydata / "precious.txt").write_text("keep me")
    assert_one_line_error(invoke("export", "tiny-llama", "-o", mydata, "--force"), "--force only replaces folders")
    assert (mydata / "precious.txt").read_text() == "keep me"
    a_file = tmp_path / "file.txt"
    a_file.write_text("keep me too")
    assert_one_line_error(invoke("export", "tiny-llama", "-o", a_file, "--force"), "is not a folder")
    assert a_file.read_text() == "keep me too"
    monkeypatch.chdir(mydata)
    for target in (".", "..", mydata):
        assert_one_line_error(invoke("export", "tiny-llama", "-o", target, "--force"), "current folder")
    assert sorted(p.name for p in mydata.iterdir()) == ["precious.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt", "mydata"]


def test_force_swaps_in_the_new_folder_in_one_step(tmp_path):
    target = tmp_path / "out"
    old, new = (json.dumps({"format_version": 3, "snapcompile_version": v, "graphs": {}, "files": {}})
                for v in ("old", "new"))
    with atomic_directory(target) as staging:
        (staging / MANIFEST).write_text(old)
    with atomic_directory(target, force=True) as staging:
        (staging / MANIFEST).write_text(new)
        assert (target / MANIFEST).read_text() == old        # the old output stays until the swap
    assert (target / MANIFEST).read_text() == new
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def _convert_in_subprocess(output: Path) -> subprocess.Popen:
    args = [sys.executable, "-m", "snapcompile.cli", "convert", "tiny-llama", "-o", str(output), "--budget", "64",
            "--window", "8", "--max-context", "4096", "--chunk", "64"]
    # a shell's background job (nohup ... &) ignores SIGINT, and so would the child: restore the default
    return subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _staging_folders(output: Path) -> list[str]:
    return sorted(p.name for p in output.parent.iterdir() if p.name.startswith(f".{output.name}."))


def _wait_for_staging(process: subprocess.Popen, output: Path) -> None:
    deadline = time.monotonic() + 120
    while not _staging_folders(output):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signals_during_convert_remove_the_staging_folder(tmp_path, sig):
    output = tmp_path / "out"
    process = _convert_in_subprocess(output)
    _wait_for_staging(process, output)
    process.send_signal(sig)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130 and "error: interrupted" in stderr and "Traceback" not in stderr
    assert list(tmp_path.iterdir()) == []


def test_staging_of_a_killed_convert_is_removed_by_the_next(tmp_path):
    output = tmp_path / "out"
    process = _convert_in_subprocess(output)
    _wait_for_staging(process, output)
    process.kill()
    process.communicate(timeout=60)
    assert _staging_folders(output) and not output.exists()
    result = invoke("convert", "tiny-llama", "-o", output, "--budget", 64, "--window", 8, "--max-context", 256,
                    "--chunk", 64)
    assert result.exit_code == 0, result.output
    assert _staging_folders(output) == [] and (output / MANIFEST).is_file()


def test_run_output_is_checked_before_anything_runs(artifact, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    a_file = tmp_path / "file.txt"
    a_file.write_text("mine")
    assert_one_line_error(invoke("run", artifact, "--prompt", "hi", "-o", tmp_path), "is a folder")
    assert_one_line_error(invoke("run", artifact, "--prompt", "hi", "-o", a_file / "out.jsonl"), "cannot write")
    assert_one_line_error(invoke("run", artifact, "--prompt", "hi", "-o", a_file), "already exists (use --force")
    assert_one_line_error(invoke("run", artifact, "--prompts", prompts, "-o", prompts, "--force"), "also an input")
    (tmp_path / "linked").symlink_to(tmp_path, target_is_directory=True)       # the same file by another path
    assert_one_line_error(invoke("run", artifact, "--prompts", prompts, "-o", tmp_path / "linked" / "prompts.jsonl",
                                 "--force"), "also an input")
    assert a_file.read_text() == "mine" and prompts.read_text() == '{"prompt": "hi"}\n'
    result = invoke("run", artifact, "--prompt", "hi", "-o", a_file, "--force", "--max-new-tokens", 2)
    assert result.exit_code == 0, result.output
    assert json.loads(a_file.read_text())["prompt"] == "hi"


@pytest.mark.parametrize("marker_text", ["{}", "[1]", '{"format_version": 3}', "not json"])
def test_force_does_not_take_any_folder_with_a_manifest_json_for_an_artifact(tiny_dense_dir, tmp_path, marker_text):
    folder = tmp_path / "f"
    folder.mkdir()
    (folder / "manifest.json").write_text(marker_text)
    (folder / "data.txt").write_text("x")
    assert_one_line_error(invoke("compress", tiny_dense_dir, "-o", folder, "--force"),
                          "has no manifest.json written by snapcompile")
    assert (folder / "data.txt").read_text() == "x"


def test_force_replaces_an_artifact_snapcompile_wrote(tiny_dense_dir, tmp_path):
    target = tmp_path / "snap"
    assert invoke("compress", tiny_dense_dir, "-o", target).exit_code == 0
    assert invoke("compress", tiny_dense_dir, "-o", target, "--force", "--budget", 128).exit_code == 0


def test_results_go_only_to_regular_files_outside_what_is_read(artifact, tmp_path):
    fifo, link, target = tmp_path / "fifo", tmp_path / "link", tmp_path / "target.txt"
    os.mkfifo(fifo)
    target.write_text("keep")
    link.symlink_to(target)
    for output in (fifo, link, Path("/dev/null")):
        assert_one_line_error(invoke("run", artifact, "--prompt", "hi", "-o", output, "--force"),
                              "is not a regular file")
    assert target.read_text() == "keep" and os.path.islink(link)
    weights = (artifact / WEIGHTS).read_bytes()
    for output in (artifact / WEIGHTS, artifact / "new.jsonl"):
        assert_one_line_error(invoke("run", artifact, "--prompt", "hi", "-o", output, "--force"),
                              "which this command reads")
    assert (artifact / WEIGHTS).read_bytes() == weights and not (artifact / "new.jsonl").exists()


def test_report_files_beside_the_output_are_never_written_through_a_link_or_into_a_fifo(tmp_path):
    """OUTPUT.md and the plots are renamed into place: a link or FIFO at their path is replaced,
    what it pointed to is untouched, and nothing blocks on the FIFO."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from snapcompile.atomic import save_figure_atomic, write_text_atomic
    target = tmp_path / "precious.txt"
    target.write_text("keep")
    (tmp_path / "report.md").symlink_to(target)
    os.mkfifo(tmp_path / "report-budget.png")
    write_text_atomic(tmp_path / "report.md", "| table |\n")
    fig = plt.figure()
    save_figure_atomic(fig, tmp_path / "report-budget.png")
    plt.close(fig)
    assert target.read_text() == "keep" and (tmp_path / "report.md").read_text() == "| table |\n"
    assert (tmp_path / "report-budget.png").read_bytes()[:4] == b"\x89PNG"


def _limited_file_size(max_bytes: int):
    """A preexec function: files this process writes stop at `max_bytes` (EFBIG, as a full disk
    stops them with ENOSPC; SIGXFSZ ignored so the write fails instead of killing the process)."""
    def limit():
        import resource
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, max_bytes))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    return limit


def _cli(*args, preexec_fn=None):
    return subprocess.run([sys.executable, "-m", "snapcompile.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=600, cwd=REPO, preexec_fn=preexec_fn)


def test_run_writes_as_it_goes_and_a_refused_results_file_keeps_every_result(tiny_dense_dir, tmp_path, monkeypatch):
    """The disk refuses the results file at the end: one error line saying where the results are,
    every one of them in the partial file."""
    import errno

    import snapcompile.atomic
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"p{i}", "id": f"r{i}"}) + "\n" for i in range(3)))
    output = tmp_path / "out.jsonl"

    def full_disk(path, text):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))
    monkeypatch.setattr(snapcompile.atomic, "write_text_atomic", full_disk)
    result = invoke("run", tiny_dense_dir, "--prompts", prompts, "-o", output, "--max-new-tokens", 2)
    assert_one_line_error(result, "No space left on device; all 3 results are in")
    identity, *kept = [json.loads(line) for line in (tmp_path / "out.jsonl.partial").read_text().splitlines()]
    assert "snapcompile run" in identity                      # what a resumed run checks (cli/run_partial.py)
    assert sorted(row["id"] for row in kept) == ["r0", "r1", "r2"] and not output.exists()
    assert_one_line_error(invoke("run", tiny_dense_dir, "--prompts", prompts, "-o", output), "use --force")
    named_like_it = tmp_path / "p.jsonl.partial"              # an input where the partial file would go
    named_like_it.write_text(prompts.read_text())
    assert_one_line_error(invoke("run", tiny_dense_dir, "--prompts", named_like_it, "-o", tmp_path / "p.jsonl",
                                 "--force"), "also an input")
    assert named_like_it.read_text() == prompts.read_text()
    monkeypatch.undo()
    result = invoke("run", tiny_dense_dir, "--prompts", prompts, "-o", output, "--max-new-tokens", 2, "--force")
    assert result.exit_code == 0, result.output
    assert [json.loads(line)["id"] for line in output.read_text().splitlines()] == ["r0", "r1", "r2"]
    assert not (tmp_path / "out.jsonl.partial").exists()


def test_a_disk_that_refuses_every_write_ends_run_in_one_line_with_the_results_printed(tiny_dense_dir, tmp_path):
    """Files stop at 8 KiB (the tokenizer's private copy fits; one result row with 40 x 5 log
    probabilities does not): the partial file breaks at its first row, the results file is refused,
    and the results come on standard output with one error line."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": "x" * 40, "id": f"r{i}"}) + "\n" for i in range(3)))
    output = tmp_path / "out.jsonl"
    result = _cli("run", tiny_dense_dir, "--prompts", prompts, "-o", output, "--max-new-tokens", 40,
                  "--ignore-eos", "--top-logprobs", 5, preexec_fn=_limited_file_size(8192))
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(errors) == 1 and "File too large" in errors[0], result.stderr
    assert "printed on standard output" in errors[0] and "Traceback" not in result.stderr
    assert sorted(json.loads(line)["id"] for line in result.stdout.splitlines()) == ["r0", "r1", "r2"]
    assert not output.exists()


def test_a_full_disk_ends_convert_in_one_line_and_leaves_no_staging_folder(tmp_path):
    output = tmp_path / "out"
    result = _cli("convert", "tiny-llama", "-o", output, "--budget", 64, "--window", 8, "--max-context", 256,
                  "--chunk", 64,
                  preexec_fn=_limited_file_size(64 * 1024))
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(errors) == 1 and "File too large" in errors[0], result.stderr
    assert "Traceback" not in result.stderr
    assert not output.exists() and _staging_folders(output) == []


SPINNING_COMMAND = """
import sys, time
import click
import snapcompile.cli
from snapcompile.cli import main
snapcompile.cli.STOP_GRACE_S = float(sys.argv[1])

@main.command("spin")
def spin():
    print("spinning", flush=True)
    while True:             # library code retrying under a bare except swallows KeyboardInterrupt
        try:
            while True:
                time.sleep(0.01)
        except:  # noqa: E722
            pass

main(["spin"])
"""


@pytest.mark.parametrize("second_signal", [False, True])
def test_a_command_that_swallows_the_interrupt_still_stops(second_signal):
    """SIGTERM ends a command even when the code it runs swallows KeyboardInterrupt: after the
    grace time, or at once on a second signal (SIGINT); exit 130 with one error line."""
    process = subprocess.Popen([sys.executable, "-c", SPINNING_COMMAND, "2" if not second_signal else "60"],
                               cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "spinning"
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    if second_signal:
        time.sleep(0.5)
        process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 130 and "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines()[-1].startswith("error: interrupted")
    assert time.monotonic() - started < (5 if second_signal else 10)


def test_an_output_name_too_long_for_the_file_system_is_one_error_line(tiny_dense_dir, tmp_path):
    long_name = tmp_path / ("a" * 300)
    assert_one_line_error(invoke("run", tiny_dense_dir, "--prompt", "hi", "-o", long_name.with_suffix(".jsonl")),
                          "File name too long")
    assert_one_line_error(invoke("convert", "tiny-llama", "-o", long_name, "--budget", 64, "--window", 8,
                                 "--max-context", 256, "--chunk", 64), "File name too long")


def test_a_stop_signal_during_a_deferred_block_arrives_at_its_end():
    """What the commands' progress bars are made under: a Ctrl-C inside tqdm's constructor would
    leave a half-made bar whose finalizer prints a traceback (seen once in the signal test above)."""
    import os

    from snapcompile.cli import _Stop, stop_signals_deferred
    stop = _Stop()
    previous = signal.signal(signal.SIGINT, stop.on_signal)
    reached_end = False
    try:
        with pytest.raises(KeyboardInterrupt):
            with stop_signals_deferred():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)
                reached_end = True
    finally:
        stop.cancel()
        signal.signal(signal.SIGINT, previous)
    assert reached_end
