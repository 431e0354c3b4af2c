"""What operators see: Prometheus metrics, health and readiness."""
