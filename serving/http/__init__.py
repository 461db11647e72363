"""The HTTP front: the FastAPI app over the core (/v1, /v2, /metrics, the demo), its transport guard and error envelope."""
