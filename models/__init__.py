"""Model loading: Hugging Face folders, GGUF files and built-in names (installed as snapcompile.models)."""
from snapcompile.models.loader import BUILTIN_MODELS, LoadedModel, load_model
from snapcompile.models.spec import SUPPORTED_ARCHITECTURES, ModelSpec

__all__ = ["BUILTIN_MODELS", "LoadedModel", "ModelSpec", "SUPPORTED_ARCHITECTURES", "load_model"]
