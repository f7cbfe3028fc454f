"""Fixture plugins shared by every test area (see tests/fixtures/)."""

pytest_plugins = [
    "fixtures.fleets",
    "fixtures.redis",
    "fixtures.sim",
    "fixtures.testhosts",
    "fixtures.vllm",
]
