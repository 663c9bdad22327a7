"""Wire formats: generated protobuf/gRPC modules and msgspec message structs.

The only translators between in-process values and bytes on a wire. Importing this package imports
nothing else: `kv_control_pb2*` are generated from proto/ by scripts/gen_proto.py (never edit them),
`bootstrap_msgs` holds the bootstrap registry's HTTP bodies, `control_msgs` the KV control plane's
values and their protobuf translation, `headers` the HTTP header names the servers and routers share.
"""
