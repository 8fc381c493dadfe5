"""What Prometheus reads at /metrics, and the view behind its bearer token."""
