"""The reward server shipped with ppoflow (`ppoflow serve-reward`): FastAPI around a reward source.

build_app(source, token, **limits)  -> FastAPI     (engines/reward_server/app.py; limits: ServerLimits' fields)
serve(source, host, port, token, **limits)         (blocks)
serve_in_thread(app)           -> context manager yielding the base URL (tests, benchmarks)
"""

from engines.reward_server.app import build_app
from engines.reward_server.runner import serve, serve_in_thread

__all__ = ["build_app", "serve", "serve_in_thread"]
