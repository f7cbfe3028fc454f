"""The built-in vLLM-compatible simulator engine (``sim``): OpenAI API, vLLM metrics, latency model.

``python -m controlplane.simulator --help`` lists the options; :func:`create_app` serves the same
replica as an ASGI app. Latency model (REFERENCE.md "Simulator model"): TTFT = ``ttft_ms`` + uncached
prompt tokens × ``prefill_ms_per_token``; then one token every ``itl_ms``; both multiplied by a load
factor that grows linearly with running sequences up to ``load_factor`` at ``max_num_seqs``.
"""

from controlplane.simulator.app import SimApp, create_app
from controlplane.simulator.cli import config_args
from controlplane.simulator.config import LatencyMode, SimConfig, SimTask
from controlplane.simulator.tokens import count_tokens, tokenize

__all__ = [
    "LatencyMode",
    "SimApp",
    "SimConfig",
    "SimTask",
    "config_args",
    "count_tokens",
    "create_app",
    "tokenize",
]
