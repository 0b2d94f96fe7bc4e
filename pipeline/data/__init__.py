"""memgas.pipeline.data package."""
