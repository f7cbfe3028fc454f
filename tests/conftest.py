"""Fixture plugins shared by every test area (see tests/fixtures/)."""

pytest_plugins = [
    "fixtures.redis",
    "fixtures.sim",
    "fixtures.testhosts",
    "fixtures.vllm",
    "fixtures.fleets",  # after fixtures.vllm, which it imports
]
