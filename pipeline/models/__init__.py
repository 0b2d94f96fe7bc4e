"""memgas.pipeline.models package."""
