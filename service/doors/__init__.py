"""The network side of a serving process: the gRPC front doors (attention.v1, KServe v2), the interceptors
(metrics, bearer tokens), and what every call shares (service/doors/calls.py). It imports no torch: an edge
process (service/multiproc/) loads this package and not the model stack."""
