"""fxsched.core."""
