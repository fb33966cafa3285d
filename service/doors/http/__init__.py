"""The HTTP front door (aiohttp, in the gRPC server's event loop): OpenAI's /v1/embeddings, Text
Embeddings Inference's routes, KServe v2 REST, and attention.v1 as JSON (docs/http.md).

Each dialect is a pair of pure functions (its JSON -> our request, our results -> its JSON) beside
one handler; admission, waiting, every call's outcome and the error table are service/doors/calls.py's
and service/errors.py's, as for the gRPC doors. This package imports no torch.
"""
