"""fxsched.specs."""
