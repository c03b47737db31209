"""fxsched.effects."""
