"""``python -m controlplane.simulator --port P --served-model-name NAME``: run one simulated replica."""

from controlplane.simulator.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
