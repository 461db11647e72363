"""The gRPC front: KServe v2 (inference.GRPCInferenceService) over the core."""
