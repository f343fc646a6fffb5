"""The studies' tests run on the product tests' tiny models and artifacts."""
from tests.conftest import tiny_dense_dir, tiny_llama, tiny_snap_dir  # noqa: F401  (fixtures, registered by import)
