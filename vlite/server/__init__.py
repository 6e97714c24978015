"""The OpenAI-compatible HTTP server (``vlite serve``) on top of AsyncLLM."""

from vlite.server.api_server import ApiServer, bind_socket, build_app

__all__ = ["ApiServer", "bind_socket", "build_app"]
