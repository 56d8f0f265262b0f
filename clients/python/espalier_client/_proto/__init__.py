"""Generated from proto/espalier/v1/espalier.proto by scripts/gen_proto.sh; do not edit."""
