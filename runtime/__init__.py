"""The runtime: the interpreter, the devices (recording, simulated, torch), scenarios and the CLI."""

from fxsched.runtime.logs import ensure_configured as _ensure_configured

_ensure_configured()
