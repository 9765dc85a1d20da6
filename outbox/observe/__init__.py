"""What the dispatcher tells the world: observer hooks, Prometheus metrics, OpenTelemetry."""
