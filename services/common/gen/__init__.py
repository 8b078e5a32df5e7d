"""Generated gRPC/protobuf code lands here (`python -m services.common.protogen`); never edit it.

grpcio-tools writes absolute imports (`from openmanus.trajectory.v1 import ...`), so this folder is
put on sys.path for them to resolve.
"""
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.append(_HERE)
