"""Generated from protos/api.proto by scripts/gen_api.py. Never edit by hand."""
