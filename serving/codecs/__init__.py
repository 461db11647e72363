"""Request bodies -> numpy: strict and fast JSON, KServe v2 tensors (HTTP and gRPC messages), images. Imports no web or RPC framework."""
