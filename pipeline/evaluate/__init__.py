"""memgas.pipeline.evaluate package."""
