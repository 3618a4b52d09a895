from tests.server import server  # noqa: F401  (the running-server fixture)
