"""The protocol-free core: lifecycle, engine, batcher and deadlines, the passes over the head, sessions, the class index (docs/ARCHITECTURE.md). Imports no web or RPC framework."""
