"""What a user is told of a rule's parameters: the one line of the config's check."""

from __future__ import annotations

from typing import Any

import pytest

from meshfl.node.config import AlgorithmConfig, ConfigError, MeshConfig, validate


def params_error(rule: str, params: dict[str, Any]) -> str:
    """The one line with which the config refuses `params` for the rule `rule`."""
    cfg = MeshConfig(algorithm=AlgorithmConfig(rule, params), coordinator="tcp://127.0.0.1:7999")
    with pytest.raises(ConfigError) as caught:
        validate(cfg)
    message = str(caught.value)
    assert "\n" not in message
    return message
