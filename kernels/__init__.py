"""memgas.kernels package."""
