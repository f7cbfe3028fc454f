"""The ``llmctl`` command line; the only package that prints."""
