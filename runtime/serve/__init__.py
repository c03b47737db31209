"""``fxsched serve``: an OpenAI-compatible HTTP server on the scheduler's drive loop.

Modules: ``protocol`` (request models, error bodies, plans), ``engine`` (the engine thread that owns
the scheduler state), ``metrics`` (Prometheus, one registry per server), ``app`` (the FastAPI app),
``server`` (uvicorn, the drain). Importing this package imports none of them: fastapi, uvicorn and
prometheus-client (the ``serve`` extra) are loaded only by the server's own modules.
"""
