"""The network side of a serving process: the doors (attention.v1 and KServe v2 over gRPC; the HTTP door with
its OpenAI, TEI, KServe v2 REST and attention.v1-as-JSON dialects) over one shared call layer
(service/doors/calls.py), the interceptors (metrics, bearer tokens) and the assembly of them all
(service/doors/build.py). It imports no torch: an edge process (service/multiproc/) loads this package and
not the model stack."""
