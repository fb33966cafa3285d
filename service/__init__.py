"""The attention encoder service: config, validation, batcher, runner, metrics, gRPC servicer and server."""
