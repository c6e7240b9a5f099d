"""The exceptions that mean "the user can fix this": one line, exit code 2."""

from meshfl.protocol.endpoint import Refused
from meshfl.protocol.identity import KeyFileError
from meshfl.protocol.transport import TransportError

from .checkpoint import CheckpointError, StorageError
from .config import ConfigError
from .coordinator import CoordinatorGone
from .data_rules import DataError
from .devices import DeviceError
from .models import ModelError
from .runtime import JoinError
from .task import TaskError

USER_ERRORS: tuple[type[Exception], ...] = (
    ConfigError,
    DataError,
    DeviceError,
    ModelError,
    TaskError,
    KeyFileError,
    TransportError,
    Refused,
    JoinError,
    CoordinatorGone,
    CheckpointError,
    StorageError,
)
