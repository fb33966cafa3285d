"""KServe v2 (the Open Inference Protocol): a transport-free core and its gRPC and REST transports."""
