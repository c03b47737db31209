"""fxsched.runtime."""
