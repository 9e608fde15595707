"""The mlx-lm worker: a process that speaks JSON Lines on stdin/stdout (see PROTOCOL.md).

This package uses only the standard library at import; mlx-lm is imported by the worker when a
model is loaded. Any program can drive it: `python -m pymlxc.bridge`, or `python path/to/bridge`.
"""
from .protocol import PROTOCOL_VERSION, CommandError, ProtocolError, Request, decode, encode, parse_request

__all__ = ["PROTOCOL_VERSION", "CommandError", "ProtocolError", "Request", "decode", "encode", "parse_request"]
