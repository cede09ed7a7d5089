"""Tools around the engine: the A/B run against the mutable baseline, benchmarks and the golden
scenario. Product code never imports this package; the command line does."""
