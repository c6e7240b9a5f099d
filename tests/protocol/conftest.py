"""The protocol tests' fixtures: live endpoints and a scene of a raw peer beside one."""

from tests.protocol.endpoints import make_endpoint as make_endpoint
from tests.protocol.endpoints import scene as scene
