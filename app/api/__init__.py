"""The HTTP surface: OpenAI- and SGLang-compatible routes, admin routes, request schemas,
streaming helpers, Prometheus metrics, and ``server.create_app`` that mounts them (and the UI)."""
