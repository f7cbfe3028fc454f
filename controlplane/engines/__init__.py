"""How to run one replica of an engine: command line, environment, health and metrics URLs."""
