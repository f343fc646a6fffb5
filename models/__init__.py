"""Model loading: Hugging Face folders, GGUF files and built-in names (installed as snapcompile.models).

The names are imported on first use: reading an artifact's manifest (models.spec) must not import
the loader, which imports transformers (the serving path runs without it)."""
from snapcompile.models.spec import SUPPORTED_ARCHITECTURES, ModelSpec

__all__ = ["BUILTIN_MODELS", "LoadedModel", "ModelSpec", "SUPPORTED_ARCHITECTURES", "load_model"]
_LOADER = ("BUILTIN_MODELS", "LoadedModel", "load_model")


def __getattr__(name: str):
    if name in _LOADER:
        from snapcompile.models import loader
        return getattr(loader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
