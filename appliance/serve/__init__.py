"""Network front ends (layer 4): the gRPC server, its proto conversions and bearer-token auth, and the
committed API stubs (api/). They drive the engine (layer 3) and read core types."""
