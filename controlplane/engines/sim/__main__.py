"""``python -m controlplane.engines.sim --port P --served-model-name NAME``: run one simulated replica."""

from controlplane.engines.sim.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
