"""A view of the source folders as the fxsched package, for mypy (pyproject: mypy_path)."""
