"""`meshfl status ADDR`: ask a live node how it is and print what it answers.

It signs the request with a throwaway key (or `--key`) and joins nothing. An encrypted
node (the default) is asked at its contact KEY@tcp://HOST:PORT, which names its key. Imports
stay on the protocol side, so asking does not wait for torch to load.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

from meshfl.node.logs import escape_controls
from meshfl.node.metrics import RoundRecord
from meshfl.protocol.identity import Identity
from meshfl.protocol.probe import StatusAnswer, ask_status
from meshfl.protocol.transport import BadContact, host_towards, split_contact

from .errors import UserError

ADDRESS = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):\d{1,5}")


def run_status(args: argparse.Namespace) -> int:
    try:
        address, node_key = split_contact(args.address)
    except BadContact as err:
        raise UserError(f"ADDR: {err}") from None
    if not ADDRESS.fullmatch(address):
        raise UserError(
            f"ADDR: got {args.address!r}; allowed: KEY@tcp://HOST:PORT, or "
            "tcp://HOST:PORT for a node with encryption off"
        )
    if args.timeout <= 0:
        raise UserError(f"--timeout: got {args.timeout:g}; allowed: seconds > 0")
    identity = Identity.load(args.key) if args.key else Identity.generate()
    answer = ask_status(identity, args.address, host_towards(address), args.timeout)
    if answer is None:
        unkeyed = (
            ""
            if node_key
            else (
                "; an encrypted node (the default) answers only at KEY@tcp://HOST:PORT, KEY its "
                "public key (the node logs it at start)"
            )
        )
        raise UserError(
            f"no status answer from {args.address} within {args.timeout:g} s: nothing "
            "listens there, the node cannot reach this machine back, or its mesh is closed "
            f"and does not list this key (pass a listed one with --key){unkeyed}"
        )
    report = status_report(answer)
    try:
        text = json.dumps(report, indent=2) if args.json else format_report(escaped(report))
    except (AttributeError, KeyError, TypeError, ValueError):
        raise UserError(
            f"the node at {args.address} answered a status this version cannot read; try --json"
        ) from None
    print(text)
    return 0


def status_report(answer: StatusAnswer) -> dict[str, Any]:
    """The node's answer, with who answered taken from the signature, not from the body."""
    return {
        **answer.status,
        "id": answer.node_id,
        "public_key": answer.sender.hex(),
        "mesh": answer.mesh_id.hex(),
    }


def escaped(value: Any) -> Any:
    """`value` with every string's control characters escaped: the node's name, its peers'
    names and addresses are whatever they said, and must not rewrite the terminal."""
    if isinstance(value, str):
        return escape_controls(value)
    if isinstance(value, dict):
        return {escaped(key): escaped(item) for key, item in value.items()}
    if isinstance(value, list):
        return [escaped(item) for item in value]
    return value


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"{report.get('name', '?')}  id {report['id']}  at {report.get('addr', '?')}",
        _progress_line(report),
        _accuracy_line(report.get("accuracies", [])),
    ]
    lines += _peer_lines(report.get("peers", []))
    rejections = report.get("rejections", {})
    listed = ", ".join(f"{reason} {count}" for reason, count in sorted(rejections.items()))
    lines.append(f"rejected messages: {listed or 'none'}")
    return "\n".join(lines)


def _progress_line(report: dict[str, Any]) -> str:
    rounds = f" of {report['rounds']}" if "rounds" in report else ""
    return (
        f"mesh {report['mesh']}  algorithm {report.get('algorithm', '?')}  "
        f"round {report.get('round', '?')}{rounds}  up {report.get('uptime_s', 0):.0f} s"
    )


def _accuracy_line(accuracies: list[dict[str, Any]]) -> str:
    """The node's last scores: each is its metrics record of that round, cut to the scores
    (a ValueError or TypeError where the node sent something else)."""
    if not accuracies:
        return "test accuracy: no round evaluated yet"
    scores = ", ".join(
        f"round {record.round} {record.test_acc:.3f}"
        for record in map(RoundRecord.from_json, accuracies)
    )
    return f"test accuracy: {scores}"


def _peer_lines(peers: list[dict[str, Any]]) -> list[str]:
    alive = sum(peer.get("state") == "alive" for peer in peers)
    lines = [f"peers: {len(peers)} known, {alive} alive"]
    if peers:
        lines.append(
            f"  {'name':<14}{'state':<7}{'round':>6}  {'last seen':>11}  {'id':<33}address"
        )
    for peer in sorted(peers, key=lambda peer: str(peer.get("name"))):
        seen = f"{peer['last_seen_s']:.1f} s ago"
        lines.append(
            f"  {peer['name']:<14}{peer['state']:<7}{peer['round']:>6}  {seen:>11}  "
            f"{peer['id']:<33}{peer['addr']}"
        )
    return lines
