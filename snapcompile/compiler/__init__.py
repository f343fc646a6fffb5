"""The one route from a model to an artifact: export, then the passes, written once (`compile_artifact`),
and the cache of artifacts the measuring tools build with it (`ArtifactCache`)."""
