"""fxsched.kernels."""
