"""memgas.jobs package."""
