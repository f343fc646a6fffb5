"""ArtifactCache: built once per (source, shapes, policy), filed under the shapes it really has."""
import pytest

from snapcompile.artifact.manifest import read_manifest
from snapcompile.compiler.cache import ArtifactCache
from snapcompile.config import ExportConfig, PolicyConfig
from snapcompile.errors import SnapcompileError
from tests.conftest import TINY_EXPORT


def test_a_dense_artifact_source_of_other_slots_or_chunk_is_refused(tiny_dense_dir, tmp_path):
    cache = ArtifactCache(str(tiny_dense_dir), tmp_path, log=lambda _: None)
    other_slots = ExportConfig(slots=TINY_EXPORT.slots + 1, max_context=256, chunk=TINY_EXPORT.chunk)
    with pytest.raises(SnapcompileError, match=f"has {TINY_EXPORT.slots} slots and chunk {TINY_EXPORT.chunk}"):
        cache.get(other_slots, PolicyConfig(budget=64, window=8, kernel=5))
    assert not any(tmp_path.iterdir())


def test_compressed_artifacts_are_filed_under_the_shapes_they_have(tiny_dense_dir, tmp_path):
    cache = ArtifactCache(str(tiny_dense_dir), tmp_path, log=lambda _: None)
    smaller = ExportConfig(slots=TINY_EXPORT.slots, max_context=256, chunk=TINY_EXPORT.chunk)
    policy = PolicyConfig(budget=64, window=8, kernel=5)
    folder = cache.get(smaller, policy)
    assert read_manifest(folder).export == read_manifest(tiny_dense_dir).export      # the source's own shapes
    assert cache.get(TINY_EXPORT, policy) == folder                                  # the same artifact, once
