"""memgas.pipeline package."""
