"""Fixture plugins shared by every test area (see tests/fixtures/)."""

pytest_plugins = [
    "fixtures.redis",
    "fixtures.testhosts",
    "fixtures.vllm",
]
