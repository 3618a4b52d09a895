"""The server process around the pure engine: ``service.py`` (one facade built from
``ServeConfig``), ``api/`` (the HTTP surface), ``backends/`` (what generates: the embedded engine
or SGLang), ``training/`` (the trainer process and hot swap), ``cli.py`` (the ``adaflash``
command)."""
